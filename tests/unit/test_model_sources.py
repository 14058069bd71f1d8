"""Model sources (specdec.core.model_source): what a model string means, and a model given as a
local folder, a GGUF file and a hub id (pulled through tests/hub_standin.py) each loaded by the
runner, generating transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.core import packs
from specdec.core.model_source import ModelNotPulled, ModelSourceError, local_files, parse_source
from specdec.core.models import ModelLoadError, load_model
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf
from tests.hub_standin import HubStandin, specdec_cli
from tests.tiny_gguf import write_tiny_llama_gguf

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
NEW_TOKENS = 12


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tiny_paths, tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tiny_paths["llama"], tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


# --------------------------------------------------------------------------- what a string means


def test_each_kind_of_source_is_recognised(tiny_paths, tiny_gguf) -> None:
    assert parse_source("smollm2-135m-instruct").kind == "pack"
    folder = parse_source(str(tiny_paths["llama"]))
    assert (folder.kind, folder.path) == ("folder", tiny_paths["llama"])
    assert local_files(folder) == (tiny_paths["llama"], None)  # used in place, nothing copied
    gguf = parse_source(str(tiny_gguf))
    assert gguf.kind == "gguf" and local_files(gguf) == (tiny_gguf.parent, tiny_gguf.name)
    hub = parse_source("acme/tiny-llama@v1.0")
    assert (hub.kind, hub.repo, hub.revision) == ("hub", "acme/tiny-llama", "v1.0")
    assert parse_source("acme/tiny@refs/pr/1").revision == "refs/pr/1"


def test_a_hub_id_without_a_revision_names_the_fix() -> None:
    with pytest.raises(ModelSourceError) as err:
        parse_source("acme/tiny-llama")
    msg = str(err.value)
    assert "no revision" in msg and "acme/tiny-llama@main" in msg and "specdec models pull" in msg


@pytest.mark.parametrize(
    "spec, words",
    [
        ("/no/such/folder", "no such file or folder"),
        ("missing.gguf", "no such file or folder"),
        ("not-a-pack", "not a model pack"),
        ("a/b/c", "not a model pack"),
    ],
)
def test_strings_that_name_no_model(spec: str, words: str) -> None:
    with pytest.raises(ModelSourceError, match=words):
        parse_source(spec)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        parse_source(str(tmp_path))


def test_an_unpulled_hub_model_says_how_to_pull_and_load_model_never_downloads(cache: Path) -> None:
    with pytest.raises(ModelNotPulled, match=r"specdec models pull acme/tiny@main"):
        local_files("acme/tiny@main")
    with pytest.raises(ModelLoadError, match="not in the model cache"):
        load_model("acme/tiny@main")
    assert not cache.exists()


def test_a_pack_keeps_its_own_error(cache: Path) -> None:
    with pytest.raises(packs.PackNotReady, match="specdec models prepare smollm2-135m-instruct"):
        local_files("smollm2-135m-instruct")


# --------------------------------------------------------------------------- loaded and run


def _runner_greedy(model) -> list[int]:
    runner = ModelRunner(model, num_slots=1, max_len=64)
    slot = runner.alloc_slot()
    out, tokens = runner.forward([slot], [PROMPT]), []
    for _ in range(NEW_TOKENS):
        tokens.append(int(out[0][-1].argmax()))
        out = runner.forward([slot], [[tokens[-1]]])
    return tokens


def _transformers_greedy(model) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.fixture(scope="module")
def reference_tokens(tiny_paths) -> list[int]:
    tokens = _transformers_greedy(load_hf(tiny_paths["llama"]))
    assert len(set(tokens)) > 1  # a real sequence, not one token repeated
    return tokens


def test_a_local_folder_runs_as_transformers_does(tiny_paths, reference_tokens) -> None:
    loaded = load_model(str(tiny_paths["llama"]))
    assert _runner_greedy(loaded.model) == reference_tokens


def test_a_gguf_file_runs_as_transformers_does(tiny_gguf, reference_tokens) -> None:
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(tiny_gguf))
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    assert _transformers_greedy(direct.eval()) == reference_tokens  # the GGUF holds the folder's model
    assert _runner_greedy(loaded.model) == reference_tokens


def test_a_hub_id_runs_from_the_cache_as_transformers_does(tiny_paths, reference_tokens, cache: Path) -> None:
    with HubStandin() as hub:
        commit = hub.add_commit("acme/tiny-llama", HubStandin.folder_files(tiny_paths["llama"]))
        result = specdec_cli(hub, cache, "models", "pull", "acme/tiny-llama@main")
    assert result.returncode == 0, result.stderr
    # the hub is gone: serving reads the pinned snapshot from the cache
    loaded = load_model("acme/tiny-llama@main")
    assert local_files("acme/tiny-llama@main")[0] == cache / "hub" / "acme" / "tiny-llama" / commit
    assert _runner_greedy(loaded.model) == reference_tokens
