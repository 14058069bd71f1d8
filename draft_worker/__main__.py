"""`python -m draft_worker --model ... --port ...`: serve DraftService without Ray.

Prints one line "draft_worker serving MODEL on HOST:PORT" once the model is loaded and the
server is up (scripts wait for it), then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import sys

from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import worker_main


def _make(config: WorkerConfig):
    from draft_worker.actor import DraftWorker

    return DraftWorker(config)


def main(argv: list[str] | None = None) -> int:
    return worker_main(
        argv, "draft", "Serve a draft model or the n-gram drafter (specdec.v1.DraftService) over gRPC.", _make
    )


if __name__ == "__main__":
    sys.exit(main())
