"""The serve.yaml the Helm chart renders into its ConfigMap (k8s/specdec, every overlay of
tests/unit/test_k8s_manifests.py) passes the serve configuration's model (`specdec config check`,
what `specdec serve --config` runs in the router pod) and its JSON Schema (`specdec config
schema`); a typo'd or mistyped `serve:` value given to the chart fails both, with its path."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from cluster.config import schema
from specdec.cli.exit_codes import OK, USAGE
from specdec.cli.main import main
from tests.unit.test_k8s_manifests import OVERLAYS, rendered


def _serve_yaml(docs: list[dict]) -> str:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-serve")]
    return cm["data"]["serve.yaml"]


def _check(text: str, tmp_path, capsys) -> tuple[int, str, list]:
    """(`specdec config check`'s exit code, its errors, the JSON Schema's errors) for a serve.yaml."""
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    code = main(["config", "check", str(path)])
    schema_errors = list(jsonschema.Draft202012Validator(schema()).iter_errors(yaml.safe_load(text)))
    return code, capsys.readouterr().err, schema_errors


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_charts_serve_config_passes_the_model(overlay, tmp_path, capsys):
    code, err, schema_errors = _check(_serve_yaml(rendered(overlay)), tmp_path, capsys)
    assert code == OK, err
    assert not schema_errors, [e.message for e in schema_errors]


@pytest.mark.parametrize(
    ("serve", "problem", "schema_says"),
    [
        ({"router": {"max_queu": 3}}, 'router.max_queu: unknown key; did you mean "max_queue"?', "max_queu"),
        ({"target": {"replcas": 2}}, 'target.replcas: unknown key; did you mean "replicas"?', "replcas"),
        ({"target": {"replicas": "two"}}, 'target.replicas: expected an integer, got "two"', "'two'"),
        ({"router": {"draft_depth": {"samples": "3"}}}, "router.draft_depth.samples: expected an integer", "'3'"),
    ],
)
def test_a_broken_serve_value_fails_the_model_and_the_schema(serve, problem, schema_says, tmp_path, capsys):
    code, err, schema_errors = _check(_serve_yaml(rendered("cpu-demo", serve=serve)), tmp_path, capsys)
    assert code == USAGE and problem in err, err
    assert any(schema_says in e.message for e in schema_errors), [e.message for e in schema_errors]
