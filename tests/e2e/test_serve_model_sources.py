"""`specdec serve` of models from anywhere, as a deployment runs them: `specdec models prepare`
(the chart's init container command) pulls a hub id through the local stand-in of the hub
(tests/hub_standin.py) into the model cache, then the stand-in is gone and `specdec serve`
(offline) serves that hub id as the target with a local folder as the draft. A second run serves
GGUF files (target and draft: a GGUF's tokenizer is rebuilt by transformers, so a draft pairs with
a target converted alike). Both answer with transformers' greedy tokens of the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.rpc.client import SpecdecClient
from tests.conftest import load_hf
from tests.e2e.serve_process import free_port, serve_process, wait_serving
from tests.hub_standin import HubStandin, specdec_cli
from tests.tiny_gguf import write_tiny_llama_gguf

HUB_ID = "acme/tiny-llama@main"
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
NEW_TOKENS = 16
WORKER = {"dtype": "float32", "num_slots": 2, "max_len": 256, "threads": 1}


def _transformers_greedy(folder: Path) -> list[int]:
    model, ids = load_hf(folder), list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def _serve_and_generate(config: dict, tmp_path: Path) -> tuple[list[dict], object]:
    port = free_port()
    config["router"] = {"port": port, "metrics_port": None, "http_port": 0, "k_policy": {"k": 3, "adaptive": False}}
    with serve_process(config, tmp_path) as (proc, log):
        wait_serving(proc, f"127.0.0.1:{port}", log, timeout=240)
        client = SpecdecClient(f"127.0.0.1:{port}")
        result = client.generate(prompt_token_ids=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True, timeout=120)
        return client.list_models(), result


def test_serve_a_hub_id_prepared_by_the_init_container_command(
    tiny_paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        hub.add_commit(HUB_ID.split("@")[0], HubStandin.folder_files(tiny_paths["llama"]))
        prepared = specdec_cli(hub, cache, "models", "prepare", "-q", HUB_ID, str(tiny_paths["llama-draft"]))
    assert prepared.returncode == 0, prepared.stderr

    monkeypatch.setenv("SPECDEC_CACHE", str(cache))  # serve_process passes this process's environment on
    config = {
        "ray": {"num_cpus": 2},
        "target": {"model": HUB_ID, **WORKER},
        "draft": {"model": str(tiny_paths["llama-draft"]), **WORKER},
    }
    models, result = _serve_and_generate(config, tmp_path)
    assert [m["name"] for m in models if m["role"] == "target"] == [HUB_ID]
    assert result.token_ids == _transformers_greedy(tiny_paths["llama"])
    assert result.stats["drafted"] > 0  # the local-folder draft drafted for the hub target


def test_serve_gguf_files(tiny_paths, tmp_path: Path) -> None:
    target = write_tiny_llama_gguf(tiny_paths["llama"], tmp_path / "tiny-llama.gguf")
    draft = write_tiny_llama_gguf(tiny_paths["llama-draft"], tmp_path / "tiny-llama-draft.gguf")
    config = {
        "ray": {"num_cpus": 2},
        "target": {"model": str(target), **WORKER},
        "draft": {"model": str(draft), **WORKER},
    }
    models, result = _serve_and_generate(config, tmp_path)
    assert [m["name"] for m in models if m["role"] == "target"] == [str(target)]
    assert result.token_ids == _transformers_greedy(tiny_paths["llama"])
    assert result.stats["drafted"] > 0
