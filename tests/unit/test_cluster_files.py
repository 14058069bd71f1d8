"""The `ray up` cluster files in cluster/: Ray accepts them, and they can hold the service of configs/cluster.yaml.

Ray's side: what `ray up` does to a file before it touches a machine, with the pinned Ray:
``prepare_config`` (the provider's defaults, the local provider's single node type, merged setup
commands, min/max workers per type) and ``validate_config`` (Ray's JSON schema and its cross-field
checks); for the local provider the whole bootstrap (``commands._bootstrap_config``). A cloud
provider's bootstrap asks its cloud (key pairs, subnets, instance types), which a test cannot.

Ours: every pool of configs/cluster.yaml (its custom resources, GPUs and CPUs, and an accelerator
type where the node type states one) is offered by some node type of every file; the setup prepares
the models the service loads; Ray starts with the same explicit ports everywhere; the router starts
after Ray on the head; Ray's token auth is on for every command of every node (cluster/env.sh, as
bash reads it) with the token file the cluster file ships there. Each rule is shown to fail on a
broken copy.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.config import ServeConfig, load_config
from specdec.core.packs import PACKS
from tests.ray_resources import actor_demand

REPO = Path(__file__).resolve().parents[2]
CLUSTER_FILES = sorted(p.stem for p in (REPO / "cluster").glob("*.yaml"))
NODE_PORTS = (
    "--node-manager-port",
    "--object-manager-port",
    "--runtime-env-agent-port",
    "--dashboard-agent-grpc-port",
    "--dashboard-agent-listen-port",
    "--metrics-export-port",
    "--min-worker-port",
    "--max-worker-port",
)
HEAD_PORTS = ("--port", "--ray-client-server-port", "--dashboard-port")
ENV_SH = REPO / "cluster" / "env.sh"


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "cluster" / f"{name}.yaml").read_text())


def serve_config() -> ServeConfig:
    return load_config(REPO / "configs" / "cluster.yaml")


def ray_up_checks(raw: dict) -> dict:
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    if raw["provider"]["type"] == "local":
        cfg = _bootstrap_config(copy.deepcopy(raw), no_config_cache=True)
    return cfg


# --------------------------------------------------------------------------- what the nodes offer


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    fixed: bool  # a machine of the local provider: Ray detects its CPUs, GPUs and GPU model itself


def _one(commands: list[str], marker: str) -> str:
    hits = [c for c in commands if marker in c]
    assert len(hits) == 1, f"expected one command with {marker!r}: {commands}"
    return hits[0]


def local_nodes(raw: dict) -> list[Node]:
    """Head and worker machines with the custom resources their `ray start` gives them."""
    head = _one(raw["head_start_ray_commands"], "ray start --head")
    match = re.search(r"--resources='([^']*)'", head)
    nodes = [Node(f"head {raw['provider']['head_ip']}", json.loads(match[1]) if match else {}, True)]
    worker = _one(raw["worker_start_ray_commands"], "ray start --address")
    cases = re.findall(r"([^\s;()]+)\)\s*RES='([^']*)'", worker)  # case $SPECDEC_NODE_IP in IP|IP) RES='{...}' ;;
    for ip in raw["provider"]["worker_ips"]:
        res = next((json.loads(r) for pattern, r in cases if any(fnmatch(ip, p) for p in pattern.split("|"))), {})
        nodes.append(Node(f"worker {ip}", res, True))
    return nodes


def nodes(raw: dict) -> list[Node]:
    if raw["provider"]["type"] == "local":
        return local_nodes(raw)
    return [Node(name, dict(t["resources"]), False) for name, t in raw["available_node_types"].items()]


def shortfall(need: dict[str, float], node: Node) -> list[str]:
    out = []
    for key, amount in need.items():
        if key in node.resources:
            if node.resources[key] < amount:
                out.append(f"{key}: {amount} > {node.resources[key]}")
        elif not (node.fixed and (key in ("CPU", "GPU") or key.startswith("accelerator_type:"))):
            out.append(f"{key}: not offered")
    return out


def unplaced(raw: dict, cfg: ServeConfig) -> list[str]:
    """Pools that no node type can hold (on fixed machines: not all their replicas)."""
    problems = []
    for role, pool in (("target", cfg.target), ("draft", cfg.draft)):
        if pool is None:
            continue
        need = actor_demand(pool.placement)
        fits = [n for n in nodes(raw) if not shortfall(need, n)]
        if not fits:
            why = {n.name: shortfall(need, n) for n in nodes(raw)}
            problems.append(f"{role} {need}: no node type offers it: {why}")
        elif fits[0].fixed:
            custom = [k for k in need if k not in ("CPU", "GPU") and not k.startswith("accelerator_type:")]
            room = sum(min((int(n.resources[k] // need[k]) for k in custom), default=1) for n in fits)
            if room < pool.replicas:
                problems.append(f"{role}: {pool.replicas} replicas, room for {room}")
    return problems


def prepared_models(raw: dict) -> set[str]:
    commands = [
        c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands") for c in raw.get(key, [])
    ]
    names: set[str] = set()
    for c in commands:
        if "models prepare" in c:
            names.update(a for a in c.split("models prepare", 1)[1].split() if not a.startswith("-"))
    return names


def needed_models(cfg: ServeConfig) -> set[str]:
    names = {cfg.target.worker.model, cfg.target.tokenizer or cfg.target.worker.model}
    if cfg.draft is not None:
        names.add(cfg.draft.worker.model)
    return names & set(PACKS)


def ports(command: str) -> dict[str, int]:
    return {flag: int(v) for flag, v in re.findall(r"(--[a-z-]*port)=(\d+)", command)}


def node_ray_auth(env_sh: Path, home: Path) -> dict[str, str]:
    """Ray's auth variables as a node's login shell has them after sourcing ``env_sh`` (HOME=home)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    show = '. "$0" && echo "${RAY_AUTH_MODE-}|${RAY_AUTH_TOKEN_PATH-}|${RAY_AUTH_TOKEN-(unset)}"'
    out = subprocess.run(["bash", "-c", show, str(env_sh)], env=env, capture_output=True, text=True, check=True)
    return dict(zip(("mode", "token_path", "token"), out.stdout.strip().split("|"), strict=True))


def ray_token_problems(raw: dict, auth: dict[str, str], home: Path) -> list[str]:
    """Token auth on, with a token file the cluster file puts on every node (see the module doc)."""
    problems = []
    if auth["mode"] != "token":
        problems.append(f"RAY_AUTH_MODE={auth['mode']!r} on the nodes")
    if auth["token"] != "(unset)":
        problems.append("RAY_AUTH_TOKEN is set on the nodes: it would win over the shipped file")
    shipped = {
        str(home / remote[2:]): local for remote, local in raw.get("file_mounts", {}).items() if remote.startswith("~/")
    }
    if auth["token_path"] not in shipped:
        problems.append(f"RAY_AUTH_TOKEN_PATH={auth['token_path']!r} is not a file_mounts target")
    elif not shipped[auth["token_path"]].startswith(("~", "/")):
        problems.append(f"the token comes from {shipped[auth['token_path']]!r}, inside the checkout")
    return problems


# --------------------------------------------------------------------------- the rules, per file


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_ray_accepts_the_cluster_file(name):
    cfg = ray_up_checks(load(name))
    assert cfg["head_node_type"] in cfg["available_node_types"]


def test_the_examples_are_all_here():
    assert {"aws", "gcp", "local"} <= set(CLUSTER_FILES)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_every_pool_is_offered_by_some_node_type(name):
    raw = load(name)
    assert unplaced(raw, serve_config()) == []
    if raw["provider"]["type"] != "local":  # the head runs the router only
        head = raw["available_node_types"][raw["head_node_type"]]["resources"]
        assert not {"draft_gpu", "target_gpu"} & set(head) and head.get("CPU") == 0


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_setup_prepares_the_models_the_service_loads(name):
    assert needed_models(serve_config()) <= prepared_models(load(name))


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_ray_starts_with_explicit_ports_then_the_router(name):
    raw = load(name)
    head_cmds, worker_cmds = raw["head_start_ray_commands"], raw["worker_start_ray_commands"]
    head, worker = _one(head_cmds, "ray start --head"), _one(worker_cmds, "ray start --address")
    head_ports, worker_ports = ports(head), ports(worker)
    assert set(head_ports) == set(NODE_PORTS + HEAD_PORTS) and set(worker_ports) == set(NODE_PORTS)
    assert {k: head_ports[k] for k in NODE_PORTS} == worker_ports
    assert f"--address=$RAY_HEAD_IP:{head_ports['--port']}" in worker
    assert head_ports == ports(_one(load("aws")["head_start_ray_commands"], "ray start --head"))  # one port plan
    # the old router goes before its Ray; the new one starts once Ray runs, from configs/cluster.yaml
    order = [
        next(i for i, c in enumerate(head_cmds) if m in c)
        for m in ("service.sh stop", "ray stop", "ray start --head", "service.sh start")
    ]
    assert order == sorted(order)
    assert "--config ~/specdec/configs/cluster.yaml" in _one(head_cmds, "service.sh start")
    assert "env.sh" in raw["setup_commands"][0] and ">> ~/.bashrc" in raw["setup_commands"][0]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_ray_token_auth_is_on_with_the_shipped_token(name, tmp_path):
    auth = node_ray_auth(ENV_SH, tmp_path)
    assert auth["mode"] == "token" and auth["token_path"] == str(tmp_path / ".specdec" / "ray-token")
    assert ray_token_problems(load(name), auth, tmp_path) == []


IMAGE_SCRIPTS = "/opt/specdec/cluster/"  # where the Dockerfile puts the node scripts
SYNC_ONLY = ("docker", "file_mounts", "setup_commands", "rsync_filter", "rsync_exclude")


def from_image_problems(raw: dict, base: dict) -> list[str]:
    """A `-docker` file runs the image: nothing of the checkout but configs/ synced, nothing
    installed, and otherwise its base file (node types, ports, commands) with the image's scripts."""
    problems = []
    if not raw.get("docker", {}).get("image"):
        problems.append("no docker.image")
    for remote, local in raw.get("file_mounts", {}).items():
        if not local.startswith("~") and (REPO / local).resolve() not in ((REPO / "configs").resolve(),):
            problems.append(f"syncs {local!r} of the checkout to {remote}")
    if any("pip install" in c for c in raw.get("setup_commands", [])):
        problems.append("installs packages: the image has them")
    copied = "COPY cluster/service.sh cluster/env.sh " + IMAGE_SCRIPTS
    if copied not in (REPO / "Dockerfile").read_text():
        problems.append(f"the Dockerfile does not put the node scripts in {IMAGE_SCRIPTS}")

    def rest(cfg: dict) -> dict:
        text = yaml.safe_dump({k: v for k, v in cfg.items() if k not in SYNC_ONLY})
        return yaml.safe_load(text.replace(IMAGE_SCRIPTS, "~/specdec/cluster/"))

    if rest(raw) != rest(base):
        problems.append("differs from its base file beyond running from the image")
    return problems


@pytest.mark.parametrize("name", [n for n in CLUSTER_FILES if n.endswith("-docker")])
def test_docker_files_run_from_the_image(name):
    assert from_image_problems(load(name), load(name.removesuffix("-docker"))) == []


def test_every_cloud_has_an_image_variant():
    assert {f"{n}-docker" for n in ("aws", "gcp", "local")} <= set(CLUSTER_FILES)


# --------------------------------------------------------------------------- broken copies fail


def test_a_docker_file_that_syncs_or_drifts_is_reported():
    base = load("aws")
    bad = load("aws-docker")
    bad["file_mounts"]["~/specdec"] = "."
    assert from_image_problems(bad, base) == ["syncs '.' of the checkout to ~/specdec"]
    bad = load("gcp-docker")
    bad["setup_commands"].append("cd ~/specdec && .venv/bin/pip install -q -e .")
    assert from_image_problems(bad, load("gcp")) == ["installs packages: the image has them"]
    bad = load("local-docker")
    bad["worker_start_ray_commands"][0] = "true"
    assert from_image_problems(bad, load("local")) == ["differs from its base file beyond running from the image"]
    bad = load("aws-docker")
    del bad["docker"]
    assert from_image_problems(bad, base) == ["no docker.image"]


def test_ray_token_auth_off_or_unshipped_is_reported(tmp_path):
    auth = node_ray_auth(ENV_SH, tmp_path)
    bad = load("aws")
    del bad["file_mounts"]["~/.specdec/ray-token"]
    (problem,) = ray_token_problems(bad, auth, tmp_path)
    assert problem.endswith("is not a file_mounts target"), problem
    bad["file_mounts"]["~/.specdec/ray-token"] = "ray-token"  # a file in the checkout: it would be committed
    assert "inside the checkout" in ray_token_problems(bad, auth, tmp_path)[0]
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(ENV_SH.read_text().replace("export RAY_AUTH_MODE=token", "export RAY_AUTH_MODE=disabled"))
    off = node_ray_auth(env_sh, tmp_path)
    assert ray_token_problems(load("gcp"), off, tmp_path) == ["RAY_AUTH_MODE='disabled' on the nodes"]
    env_sh.write_text(ENV_SH.read_text() + "export RAY_AUTH_TOKEN=abc\n")
    assert "would win" in ray_token_problems(load("local"), node_ray_auth(env_sh, tmp_path), tmp_path)[0]


def test_a_broken_cluster_file_fails_rays_checks():
    bad = load("aws")
    bad["available_node_types"]["draft_a10g"]["resources"]["draft_gpu"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="'one' is not of type 'integer'"):
        ray_up_checks(bad)
    bad = load("gcp")
    bad["head_node_typo"] = "head"
    with pytest.raises(jsonschema.ValidationError, match="head_node_typo"):
        ray_up_checks(bad)
    bad = load("aws")
    bad["available_node_types"]["draft_a10g"]["min_workers"] = 7  # more than max_workers in all
    with pytest.raises(ValueError, match="max_workers"):
        ray_up_checks(bad)
    bad = load("local")
    bad["available_node_types"] = {"x": {"resources": {}, "node_config": {}}}  # not for on-premise clusters
    with pytest.raises(click.ClickException):
        ray_up_checks(bad)


def test_a_pool_nobody_offers_is_reported():
    cfg = serve_config()
    bad = load("aws")
    del bad["available_node_types"]["draft_a10g"]["resources"]["draft_gpu"]
    assert [p.split(" ")[0] for p in unplaced(bad, cfg)] == ["draft"]
    bad = load("local")
    bad["provider"]["worker_ips"] = ["10.0.0.99"]  # not in the worker's resource map
    assert [p.split(" ")[0] for p in unplaced(bad, cfg)] == ["target"]
    bad = load("local")
    head = bad["head_start_ray_commands"]
    bad["head_start_ray_commands"] = [c.replace('"draft_gpu": 2', '"draft_gpu": 1') for c in head]
    assert unplaced(bad, cfg) == ["draft: 2 replicas, room for 1"]


def test_an_accelerator_type_is_checked_where_the_node_types_state_one():
    raw = yaml.safe_load((REPO / "configs" / "cluster.yaml").read_text())
    raw["target"]["placement"]["accelerator_type"] = "A100"
    raw["draft"]["placement"]["accelerator_type"] = "A10G"
    pinned = ServeConfig.from_dict(raw)
    assert unplaced(load("aws"), pinned) == []
    assert [p.split(" ")[0] for p in unplaced(load("gcp"), pinned)] == ["draft"]  # GCP drafts run on L4
    assert unplaced(load("local"), pinned) == []  # Ray detects the GPU model of your own machines
    raw["target"]["placement"]["accelerator_type"] = "H100"
    assert [p.split(" ")[0] for p in unplaced(load("aws"), ServeConfig.from_dict(raw))] == ["target"]


def test_a_model_the_setup_does_not_prepare_is_reported():
    raw = yaml.safe_load((REPO / "configs" / "cluster.yaml").read_text())
    raw["draft"]["model"] = "smollm2-135m-instruct"
    assert not needed_models(ServeConfig.from_dict(raw)) <= prepared_models(load("aws"))


# --------------------------------------------------------------------------- the node scripts


def test_service_script_without_a_service(tmp_path):
    script = REPO / "cluster" / "service.sh"
    for path in (script, REPO / "cluster" / "env.sh"):
        subprocess.run(["bash", "-n", str(path)], check=True)
    env = dict(
        os.environ, HOME=str(tmp_path), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO)
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)

    out = run("status")
    assert out.returncode == 1 and "not running" in out.stderr
    out = run("stop")
    assert out.returncode == 0 and "not running" in out.stdout
    assert run("frobnicate").returncode == 2
    out = run("start", "--config", str(tmp_path / "missing.yaml"))  # specdec serve exits at once: say why
    assert out.returncode == 1 and "exited at once" in out.stderr and "cannot read config" in out.stderr
    assert not (tmp_path / ".specdec" / "serve.pid").exists() or run("status").returncode == 1
