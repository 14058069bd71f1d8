"""`specdec config`: the serve configuration's JSON Schema (for editors) and a file's check.

``specdec config schema`` prints the schema generated from the typed model (cluster/config.py's
ServeConfig); ``specdec config check FILE...`` validates files against the model itself, which
also applies the rules across keys a schema cannot express (``max_k`` against
``router.k_policy.k_max``, ...), and lists every problem of each file. The model is imported inside
the handlers: ``specdec --help`` loads no grpc (tests/unit/test_layers.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec.cli.exit_codes import OK, USAGE


def _schema(args: argparse.Namespace) -> int:
    from cluster.config import schema

    print(json.dumps(schema(), indent=2))
    return OK


def _check(args: argparse.Namespace) -> int:
    from cluster.config import load_config

    code = OK
    for path in args.files:
        try:
            load_config(path)
        except ValueError as exc:  # cluster.config.ConfigError: every problem, with its path
            print(f"error: {exc}", file=sys.stderr)
            code = USAGE
            continue
        print(f"{path}: ok")
    return code


def add_config(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="the serve configuration: its JSON Schema, check files")
    csub = config.add_subparsers(dest="config_command", required=True)

    p = csub.add_parser("schema", help="print the JSON Schema of a serve config file (editor validation)")
    p.set_defaults(func=_schema)

    p = csub.add_parser("check", help="validate serve config files; every problem is listed, with its path")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML config (as `specdec serve --config` reads it)")
    p.set_defaults(func=_check)
