"""The chart's values.schema.json: Helm checks the values against it on every install, upgrade and
`helm template` (rendered here through Helm's own engine, helm-python-sdk), so a typo'd or
mistyped value fails the render instead of being ignored.

* The schema is a valid draft 2020-12 schema; the chart's values.yaml and every overlay satisfy it.
* Closed wherever the chart's structure is fixed (`additionalProperties: false`); open only where
  the value is Kubernetes' own (affinity, resources' quantities, env and volume entries, labels)
  Its `serve` is the serve config's own schema (`specdec config schema`, kept in step by
  scripts/chart_schema.py: tests/unit/test_chart_serve_schema.py).
* Broken values fail the render: a misspelt key at each level (under `serve` too), a wrong type, a
  value outside an enum.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from helm_python.errors import HelmValuesError

from tests.unit.test_k8s_manifests import K8S, OVERLAYS, render_k8s, rendered

SCHEMA_FILE = K8S / "specdec" / "values.schema.json"
# Paths (dotted; [] for list items) whose objects are open on purpose.
OPEN = {"head.affinity", "gateway.affinity", "draft.affinity", "target.affinity"}


def schema() -> dict:
    return json.loads(SCHEMA_FILE.read_text())


def open_objects(node: dict, path: str = "") -> list[str]:
    """Paths of object schemas that accept keys they do not name."""
    found = []
    if node.get("type") == "object" or "object" in (node.get("type") or []):
        if "properties" in node and node.get("additionalProperties") is not False:
            found.append(path)
        if "properties" not in node and "additionalProperties" not in node:
            found.append(path)
    for key, sub in (node.get("properties") or {}).items():
        found += open_objects(sub, f"{path}.{key}" if path else key)
    return found


def test_schema_is_valid_and_closed():
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    assert set(open_objects(s)) == OPEN


def test_values_and_overlays_satisfy_it():
    validator = jsonschema.Draft202012Validator(schema())
    defaults = yaml.safe_load((K8S / "specdec" / "values.yaml").read_text())
    for name, (values_file, overrides) in OVERLAYS.items():
        values = yaml.safe_load(values_file.read_text()) if values_file else {}
        merged = render_k8s.merge_values(render_k8s.merge_values(defaults, values), overrides)
        merged = _drop_nulls(merged)  # Helm: null removes a key
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(merged)]
        assert not errors, f"{name}: {errors}"


def _drop_nulls(d):
    if isinstance(d, dict):
        return {k: _drop_nulls(v) for k, v in d.items() if v is not None}
    return d


BROKEN = {
    "replica (typo) in a group": {"target": {"replica": 2}},
    "replicas for an autoscaled group": {"target": {"replicas": 2}},
    "typo at the top": {"routr": {"port": 50051}},
    "typo in a nested section": {"router": {"tls": {"secretNme": "x"}}},
    "typo in resources": {"draft": {"resources": {"limit": {"cpu": "1"}}}},
    "port as a string": {"router": {"port": "50051"}},
    "port out of range": {"gateway": {"port": 70000}},
    "log format not in the enum": {"router": {"logFormat": "xml"}},
    "Ray auth mode not in the enum": {"rayAuth": {"mode": "off"}},
    "negative GPUs": {"target": {"gpus": -1}},
    "networkPolicy typo": {"networkPolicy": {"enable": False}},
    "tolerations as a map": {"target": {"tolerations": {"key": "x"}}},
    "PDB typo": {"disruptionBudgets": {"head": {"maxUnavailble": 1}}},
    "serve typo at its top": {"serve": {"routr": {}}},
    "serve typo in a section": {"serve": {"router": {"max_queu": 3}}},
    "serve typo in a pool": {"serve": {"target": {"replcas": 2}}},
    "serve value of a wrong type": {"serve": {"target": {"replicas": "two"}}},
    "serve value outside its enum": {"serve": {"target": {"dtype": "float8"}}},
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_values_fail_the_render(case):
    with pytest.raises(HelmValuesError):
        rendered("gpu", **BROKEN[case])


def test_a_serve_typo_names_its_path():
    with pytest.raises(HelmValuesError, match="at '/serve/router': additional properties 'max_queu' not allowed"):
        rendered("gpu", serve={"router": {"max_queu": 3}})
