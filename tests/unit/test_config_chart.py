"""The serve.yaml the Helm chart renders into its ConfigMap (k8s/specdec, every overlay of
tests/unit/test_k8s_manifests.py) passes the serve configuration's model (`specdec config check`,
what `specdec serve --config` runs in the router pod) and its JSON Schema (`specdec config
schema`); a typo'd or mistyped `serve:` value given to the chart fails Helm's values check (the
chart's values.schema.json holds the same schema), the model and the schema, each with its path."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from helm_python.errors import HelmValuesError

from cluster.config import schema
from specdec.cli.exit_codes import OK, USAGE
from specdec.cli.main import main
from tests.unit.test_k8s_manifests import OVERLAYS, render_k8s, rendered


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
    ("serve", "problem", "schema_says", "helm_says"),
    [
        (
            {"router": {"max_queu": 3}},
            'router.max_queu: unknown key; did you mean "max_queue"?',
            "max_queu",
            "at '/serve/router': additional properties 'max_queu' not allowed",
        ),
        (
            {"target": {"replcas": 2}},
            'target.replcas: unknown key; did you mean "replicas"?',
            "replcas",
            "at '/serve/target': additional properties 'replcas' not allowed",
        ),
        (
            {"target": {"replicas": "two"}},
            'target.replicas: expected an integer, got "two"',
            "'two'",
            "at '/serve/target/replicas': got string, want integer",
        ),
        (
            {"router": {"draft_depth": {"samples": "3"}}},
            "router.draft_depth.samples: expected an integer",
            "'3'",
            "at '/serve/router/draft_depth/samples': got string, want integer",
        ),
    ],
)
def test_a_broken_serve_value_fails_helm_the_model_and_the_schema(
    serve, problem, schema_says, helm_says, tmp_path, capsys
):
    # Helm refuses it first (values.schema.json's serve is the model's schema) ...
    with pytest.raises(HelmValuesError) as err:
        rendered("cpu-demo", serve=serve)
    assert helm_says in str(err.value)
    # ... and the serve.yaml it would have rendered fails the router's own check and the schema
    good = yaml.safe_load(_serve_yaml(rendered("cpu-demo")))
    broken = yaml.safe_dump(render_k8s.merge_values(good, serve))
    code, err_text, schema_errors = _check(broken, tmp_path, capsys)
    assert code == USAGE and problem in err_text, err_text
    assert any(schema_says in e.message for e in schema_errors), [e.message for e in schema_errors]
