"""`python -m target_worker --model ... --port ...`: serve TargetService without Ray.

Prints one line "target_worker serving MODEL on HOST:PORT" once the model is loaded and the
server is up (scripts wait for it), then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import sys

from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import worker_main


def _make(config: WorkerConfig):
    from target_worker.actor import TargetWorker

    return TargetWorker(config)


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, "target", "Serve a target model (specdec.v1.TargetService) over gRPC.", _make)


if __name__ == "__main__":
    sys.exit(main())
