"""`specdec` command line.

Each command group registers itself with one ``_add_<group>(sub)`` function listed in
``_COMMANDS``; a subparser sets ``func`` to a handler ``(args) -> exit code``. To add a command
(generate, bench, serve), write its ``_add_...`` function and append it to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from specdec.cli.bench import add_bench
from specdec.cli.bench_rebalance import add_bench_rebalance
from specdec.cli.config import add_config
from specdec.cli.exit_codes import FAILED
from specdec.cli.generate import add_generate
from specdec.cli.models import add_models
from specdec.cli.plan import add_plan
from specdec.cli.serve import add_serve
from specdec.core import packs
from specdec.core.log_format import TEXT_FORMAT

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- entry point

_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_models,
    add_generate,
    add_bench,
    add_serve,
    add_bench_rebalance,
    add_plan,
    add_config,
]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=TEXT_FORMAT)
    try:
        return args.func(args)
    except packs.PackError as exc:  # a message a person can act on, not a stack trace
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
