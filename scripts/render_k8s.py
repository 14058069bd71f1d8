"""Render the Helm chart in ``k8s/specdec`` with an overlay, offline and without a helm binary.

Uses Helm's own Go engine through ``helm-python-sdk`` (the dev extra), so the output is what
``helm template`` gives. For people without helm::

    .venv/bin/python scripts/render_k8s.py k8s/values-gpu.yaml > specdec.yaml && kubectl apply -f specdec.yaml
    .venv/bin/python scripts/render_k8s.py k8s/values-cpu-demo.yaml --set '{"rayAuth": {"mode": "disabled"}}'

tests/unit/test_k8s_manifests.py renders through :func:`render` too.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "k8s" / "specdec"

__all__ = ["CHART", "merge_values", "render"]


def merge_values(base: dict, override: dict) -> dict:
    """Helm's rule for several values files: maps merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(
    values_file: str | Path | None = None,
    overrides: dict | None = None,
    *,
    chart: Path = CHART,
    release: str = "specdec",
    namespace: str = "default",
) -> list[dict[str, Any]]:
    """The chart's manifests (parsed), in template order, for the values file plus ``overrides``."""
    import helm_python  # the dev extra; imported here so `--help` works without it

    values = (yaml.safe_load(Path(values_file).read_text()) or {}) if values_file else {}
    values = merge_values(values, overrides or {})
    with helm_python.Chart.load(str(chart)) as loaded:
        rendered = loaded.render(values, name=release, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(rendered):
        if path.endswith((".yaml", ".yml")):
            docs.extend(d for d in yaml.safe_load_all(rendered[path]) if d)
    return docs


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the serve config, the router's script) as readable | blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("values", nargs="?", help="overlay values file (k8s/values-*.yaml); default: the chart's defaults")
    p.add_argument("--set", default=None, metavar="JSON", help="values on top of the overlay, as a JSON object")
    p.add_argument("--release", default="specdec")
    p.add_argument("--namespace", default="default")
    args = p.parse_args(argv)
    docs = render(
        args.values, json.loads(args.set) if args.set else None, release=args.release, namespace=args.namespace
    )
    yaml.dump_all(docs, sys.stdout, Dumper=_Dumper, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
