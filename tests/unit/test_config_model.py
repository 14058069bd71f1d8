"""The serve configuration as one typed model (cluster/config.py's ServeConfig, validated by
pydantic: specdec/rpc/config_model.py): each rule holds for a good file and fails a broken one.

* a file names only what differs from the defaults;
* unknown keys are refused with their path (and the closest known key);
* wrong types are refused with their path, strictly (``"2"`` and ``true`` are not integers);
* one error lists every problem, whatever section it is in;
* the older ``router.rebalance`` keys still work, and one written twice is refused;
* ``specdec serve --config`` (and ``specdec config check``) print the problems and exit with the
  usage code before anything starts;
* ``specdec config schema`` is a JSON Schema the shipped configs pass and a typo'd key fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import DEFAULT_TARGET_MODEL, ConfigError, load_config, schema
from router.config import RouterConfig
from specdec.cli.exit_codes import OK, USAGE
from specdec.cli.main import main
from specdec.rpc.worker_config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _load(tmp_path: Path, text: str, **overrides):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return load_config(path, **overrides)


def _problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    return err.value.problems


def test_a_file_names_only_what_differs(tmp_path):
    cfg = _load(tmp_path, "router: {port: 50052}\n")
    assert cfg.router.port == 50052
    assert cfg.router.to_dict() == {**RouterConfig().to_dict(), "port": 50052}
    assert cfg.target.worker.model == DEFAULT_TARGET_MODEL and cfg.target.replicas == 1 and cfg.draft is None
    assert cfg.target.worker.max_k == cfg.router.k_policy.k_max and cfg.target.worker.threads >= 1
    partial = _load(tmp_path, "target: {replicas: 2}\n")  # no target.model: the default model
    assert (partial.target.worker.model, partial.target.replicas) == (DEFAULT_TARGET_MODEL, 2)
    assert _load(tmp_path, "").to_dict() == _load(tmp_path, "ray:\nrouter:\nsecurity:\n").to_dict()


def test_unknown_keys_are_refused_with_their_path(tmp_path):
    assert _problems(tmp_path, "router: {draft_depth: {smaples: 2}}\n") == [
        'router.draft_depth.smaples: unknown key; did you mean "samples"?'
    ]
    assert _problems(tmp_path, "routr: {port: 1}\n") == ['routr: unknown key; did you mean "router"?']
    # a pool's own keys and its worker's sit side by side in the file, and in the paths
    assert _problems(tmp_path, "target: {model: m, replcas: 2}\n") == [
        'target.replcas: unknown key; did you mean "replicas"?'
    ]
    assert _problems(tmp_path, "draft: {model: m, num_slot: 2}\n") == [
        'draft.num_slot: unknown key; did you mean "num_slots"?'
    ]
    assert _problems(tmp_path, "security: {zzz: 1}\n") == ["security.zzz: unknown key"]
    # an older key mistyped: suggested where it lives now
    (line,) = _problems(tmp_path, "router: {rebalance: {move_margn: 2}}\n")
    assert line == 'router.rebalance.move_margn: unknown key; did you mean "router.drafter_choice.move_margin"?'


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("target: {replicas: two}", 'target.replicas: expected an integer, got "two"'),
        ("target: {replicas: '2'}", 'target.replicas: expected an integer, got "2"'),
        ("target: {num_slots: true}", "target.num_slots: expected an integer, got true"),
        ("target: {max_len: 1.5}", "target.max_len: expected an integer, got 1.5"),
        ("router: {predraft: 'yes'}", 'router.predraft: expected true or false, got "yes"'),
        ("router: {draft_deadline_s: fast}", 'router.draft_deadline_s: expected a number, got "fast"'),
        ("router: {k_policy: {k_max: [1]}}", "router.k_policy.k_max: expected an integer, got [1]"),
        ("ray: {namespace: 7}", "ray.namespace: expected a string, got 7"),
        ("router: {scaling: 3}", "router.scaling: expected a mapping, got 3"),
        ("target: {replicas: 0}", "target.replicas: must be >= 1, got 0"),
        ("target: {dtype: float8}", "target.dtype: must be one of"),  # the section's own rule, with its path
    ],
)
def test_wrong_types_and_values_are_refused_with_their_path(tmp_path, text, problem):
    (line,) = _problems(tmp_path, text + "\n")
    assert line.startswith(problem), line


def test_the_right_types_pass(tmp_path):
    cfg = _load(tmp_path, "target: {replicas: 2, num_slots: 4, max_len: 512}\nrouter: {predraft: true, grace_s: 1}\n")
    assert (cfg.target.replicas, cfg.target.worker.num_slots, cfg.router.predraft) == (2, 4, True)
    assert cfg.router.grace_s == 1.0 and isinstance(cfg.router.grace_s, float)  # an integer is a number


def test_every_problem_is_listed_at_once(tmp_path):
    text = (
        "target: {replicas: two}\n"
        "draft: {model: d, dtype: float8}\n"
        "router: {max_queu: 3, drafter_choice: {move_margin: 0.5}}\n"
        "ray: {namespace: 7}\n"
        "security: {exempt: [metrics]}\n"
    )
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    problems = err.value.problems
    assert len(problems) == 6, problems
    for start in ("target.replicas", "draft.dtype", "router.max_queu", "router.drafter_choice.move_margin"):
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert str(err.value).startswith(f"config {tmp_path / 'serve.yaml'}: 6 problems:")
    assert all(f"  - {p}" in str(err.value) for p in problems)


def test_a_config_built_directly_follows_the_same_rules():
    """The rules are the fields' types: a section built in code is held to them too."""
    with pytest.raises(ConfigError, match=r"router.max_queue: must be > 0, got 0"):
        RouterConfig(max_queue=0)
    with pytest.raises(ConfigError, match="router.default_mode: must be one of 'draft', 'ngram' or 'off'"):
        RouterConfig(default_mode="fast")
    with pytest.raises(ConfigError, match="port: must be <= 65535"):
        WorkerConfig(model="m", port=70000)
    assert RouterConfig(max_queue=1, default_mode="off").max_queue == 1


def test_rules_across_sections_still_hold(tmp_path):
    (line,) = _problems(tmp_path, "target: {model: m, max_k: 4}\nrouter: {k_policy: {k: 3, k_max: 9}}\n")
    assert "target.max_k (4) is below router.k_policy.k_max (9)" in line
    (line,) = _problems(tmp_path, "target: {model: ngram}\n")
    assert "target.model: a target needs a model" in line
    assert _load(tmp_path, "draft: {model: none}\n").draft is None  # the same as `draft: null`


def test_older_rebalance_keys_still_work_in_a_file(tmp_path):
    old = _load(tmp_path, "router: {auto_off_batch: 8, rebalance: {move_margin: 2.0, depth_samples: 4}}\n")
    new = _load(tmp_path, "router: {speculation_off: {auto_off_batch: 8}, drafter_choice: {move_margin: 2.0}, "
                "draft_depth: {samples: 4}}\n")  # fmt: skip
    assert old.router == new.router and old.router.drafter_choice.move_margin == 2.0
    with pytest.raises(ValueError, match="write it once"):
        _load(tmp_path, "router: {rebalance: {move_margin: 2.0}, drafter_choice: {move_margin: 3.0}}\n")


BAD = "target: {replicas: two}\nrouter: {draft_depth: {smaples: 2}}\n"


def test_serve_shows_the_problems_and_exits_before_starting_anything(tmp_path):
    """As a user runs it: the real command line, in its own process."""
    path = tmp_path / "serve.yaml"
    path.write_text(BAD)
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == USAGE, out.stderr
    assert 'target.replicas: expected an integer, got "two"' in out.stderr
    assert 'router.draft_depth.smaples: unknown key; did you mean "samples"?' in out.stderr
    assert "Ray" not in out.stderr + out.stdout and "Traceback" not in out.stderr  # nothing started


def test_other_commands_with_a_config_refuse_it_too(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text(BAD)
    assert main(["plan", "--target", DEFAULT_TARGET_MODEL, "--rate", "1", "--config", str(path)]) == USAGE
    assert "router.draft_depth.smaples: unknown key" in capsys.readouterr().err


def test_config_check(tmp_path, capsys):
    assert main(["config", "check", *map(str, CONFIGS)]) == OK
    assert capsys.readouterr().out.count(": ok") == len(CONFIGS)
    path = tmp_path / "serve.yaml"
    path.write_text(BAD)
    assert main(["config", "check", str(CONFIGS[0]), str(path)]) == USAGE
    out = capsys.readouterr()
    assert "2 problems" in out.err and f"{CONFIGS[0]}: ok" in out.out


@pytest.fixture(scope="module")
def printed_schema() -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "config", "schema"], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(out.stdout)


def test_schema_is_the_models(printed_schema):
    assert printed_schema == schema()
    jsonschema.Draft202012Validator.check_schema(printed_schema)
    pool = printed_schema["$defs"]["PoolConfig"]["properties"]
    assert {"model", "replicas", "num_slots", "placement", "tensor_parallel"} <= set(pool)  # flat, as files write it
    assert "worker" not in pool


def test_the_shipped_configs_pass_the_schema_and_a_typo_fails(printed_schema):
    validator = jsonschema.Draft202012Validator(printed_schema)
    for path in CONFIGS:
        raw = yaml.safe_load(path.read_text())
        assert not list(validator.iter_errors(raw)), path
        for broken in (
            {**raw, "router": {**raw["router"], "max_queu": 3}},
            {**raw, "target": {**raw["target"], "replicas": "two"}},
            {**raw, "target": {**raw["target"], "replicas": 0}},
            {**raw, "router": {**raw["router"], "default_mode": "fast"}},
            {**raw, "router": {**raw["router"], "draft_depth": {"smaples": 2}}},
        ):
            assert list(validator.iter_errors(broken)), path
    older = {"router": {"rebalance": {"move_margin": 2.0}, "auto_off_batch": 3}, "target": {"threads": "auto"}}
    assert not list(validator.iter_errors(older))  # still read: in the schema, marked deprecated


def test_a_printed_config_reads_back_as_the_same(tmp_path):
    """`specdec serve --print-config` writes every key: the model reads it back unchanged."""
    for path in CONFIGS:
        cfg = load_config(path)
        assert _load(tmp_path, yaml.safe_dump(cfg.to_dict())) == cfg, path
