"""The chart's values.schema.json holds, as its `serve`, the serve configuration's own JSON Schema
(`specdec config schema`, from the typed model in cluster/config.py): regenerated here with
scripts/chart_schema.py and compared, so a change to the model that the chart's file does not follow
fails; a file that drifted (an old free `serve`, a key the model no longer has) fails the check."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from cluster.config import schema
from specdec.cli.main import main as specdec_main

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location("chart_schema", REPO / "scripts" / "chart_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


chart_schema = _load_script()


def _file() -> dict:
    return json.loads(chart_schema.SCHEMA_FILE.read_text())


def test_the_charts_serve_is_the_serve_configs_schema():
    assert chart_schema.main(["--check"]) == 0, "run: .venv/bin/python scripts/chart_schema.py"
    assert chart_schema.SCHEMA_FILE.read_text() == chart_schema.render_file(_file())


def test_it_is_what_specdec_config_schema_prints(capsys):
    assert specdec_main(["config", "schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    serve = _file()["properties"]["serve"]
    assert set(serve["properties"]) == set(printed["properties"]) == set(schema()["properties"])
    for name, definition in printed["$defs"].items():  # the same rules, references rebased into the chart
        rebased = json.loads(json.dumps(definition).replace('"#/$defs/', f'"{chart_schema.SERVE_DEFS}'))
        assert serve["$defs"][name] == rebased, name
    assert serve["additionalProperties"] is False


def _stale(tmp_path: Path, edit) -> Path:
    current = _file()
    stale = copy.deepcopy(current)
    edit(stale["properties"]["serve"])
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale, indent=2) + "\n")
    return path


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda s: (s.clear(), s.update(type="object")), id="a free serve object"),
        pytest.param(lambda s: s["$defs"]["RouterConfig"]["properties"].pop("max_queue"), id="a key missing"),
        pytest.param(lambda s: s["$defs"]["PoolConfig"]["properties"].update(replicaz={}), id="a key too many"),
        pytest.param(lambda s: s["$defs"]["PoolConfig"]["properties"]["dtype"]["enum"].pop(), id="an enum shrunk"),
    ],
)
def test_a_drifted_file_fails_the_check_and_is_rewritten(edit, tmp_path, capsys):
    path = _stale(tmp_path, edit)
    assert chart_schema.main(["--check", "--file", str(path)]) == 1
    assert "run scripts/chart_schema.py" in capsys.readouterr().err
    assert chart_schema.main(["--file", str(path)]) == 0  # rewritten: now in step
    assert path.read_text() == chart_schema.SCHEMA_FILE.read_text()
