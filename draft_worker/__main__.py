"""`python -m draft_worker --model ... --port ...`: serve DraftService without Ray.

Prints one line "draft_worker serving MODEL on HOST:PORT" once the model is loaded and the
server is up (scripts wait for it), then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specdec.rpc.serving import add_worker_args, config_from_args, serve_until_signal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m draft_worker",
        description="Serve a draft model or the n-gram drafter (specdec.v1.DraftService) over gRPC.")
    add_worker_args(parser, "draft")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        from draft_worker.actor import DraftWorker

        worker = DraftWorker(config)
    except Exception as exc:  # noqa: BLE001 - a command line: one readable line, no trace
        print(f"draft_worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"draft_worker serving {config.model} on {worker.address()}", flush=True)
    serve_until_signal(worker.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
