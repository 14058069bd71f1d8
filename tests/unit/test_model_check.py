"""Models checked before any worker starts (specdec.core.model_check): an architecture the runner
does not support and a draft on another vocabulary each fail with the model's name and the reason;
`specdec serve` refuses them before Ray starts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from specdec.core.model_check import (
    RUNNER_MODEL_TYPES,
    ModelCheckError,
    check_architecture,
    check_models,
    tokenizer_fingerprint,
)
from specdec.core.runner import SUPPORTED_ARCHS
from specdec.core.tokenizer_spec import vocab_fingerprint
from tests.e2e.serve_process import REPO, SPECDEC, cli_env


def _edited_copy(src: Path, dest: Path, **config) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def gpt2_like(tiny_paths, tmp_path_factory) -> Path:
    """The tiny Llama's files claiming an architecture the runner has no kernels for."""
    return _edited_copy(
        tiny_paths["llama"], tmp_path_factory.mktemp("m") / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"]
    )


@pytest.fixture(scope="module")
def other_vocab(tiny_paths, tmp_path_factory) -> Path:
    """A Llama draft whose tokenizer has one more token than the target's."""
    from transformers import AutoTokenizer

    dest = tmp_path_factory.mktemp("m") / "other-vocab"
    shutil.copytree(tiny_paths["llama-draft"], dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(dest)
    return dest


def test_the_check_knows_exactly_the_runners_architectures() -> None:
    assert sorted(RUNNER_MODEL_TYPES.values()) == sorted(SUPPORTED_ARCHS)


def test_supported_models_and_a_matching_draft_pass(tiny_paths) -> None:
    check_models(str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]))
    check_models(str(tiny_paths["qwen2"]), "ngram")
    check_models(str(tiny_paths["qwen2"]), None)


def test_a_wrong_architecture_names_the_model_and_what_is_supported(gpt2_like: Path) -> None:
    with pytest.raises(ModelCheckError) as err:
        check_architecture(str(gpt2_like))
    msg = str(err.value)
    assert str(gpt2_like) in msg and "GPT2LMHeadModel" in msg and "LlamaForCausalLM, Qwen2ForCausalLM" in msg


@pytest.mark.parametrize(
    "config, words",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "biases on o_proj"),
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding-window"),
    ],
)
def test_unsupported_variants_of_a_supported_architecture(tiny_paths, tmp_path: Path, config, words) -> None:
    with pytest.raises(ModelCheckError, match=words):
        check_architecture(str(_edited_copy(tiny_paths["llama"], tmp_path / "m", **config)))


def test_a_gguf_is_checked_from_its_header(tiny_paths, tmp_path: Path) -> None:
    from tests.tiny_gguf import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tiny_paths["llama"], tmp_path / "tiny.gguf")
    check_architecture(str(gguf))
    (tmp_path / "broken.gguf").write_bytes(gguf.read_bytes()[:64])
    with pytest.raises(ModelCheckError, match="not a readable GGUF file"):
        check_architecture(str(tmp_path / "broken.gguf"))


def test_an_incompatible_tokenizer_names_both_models(tiny_paths, other_vocab: Path) -> None:
    with pytest.raises(ModelCheckError) as err:
        check_models(str(tiny_paths["llama"]), str(other_vocab))
    msg = str(err.value)
    assert str(other_vocab) in msg and str(tiny_paths["llama"]) in msg and "incompatible tokenizers" in msg


def test_the_fingerprint_is_the_one_a_worker_publishes(tiny_paths, other_vocab: Path) -> None:
    # workers publish vocab_fingerprint(tokenizer.get_vocab()) (specdec.core.tokenizer_spec): the check
    # reads tokenizer.json without transformers and must agree with it, added tokens included
    from transformers import AutoTokenizer

    for folder in (tiny_paths["llama"], other_vocab):
        expected = vocab_fingerprint(AutoTokenizer.from_pretrained(folder).get_vocab())
        assert tokenizer_fingerprint(str(folder)) == expected


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [*SPECDEC, "serve", "--port", "0", "--metrics-port", "-1", "--http-port", "0", *args]
    return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)


def test_serve_refuses_a_wrong_model_before_ray_starts(tiny_paths, gpt2_like: Path, other_vocab: Path) -> None:
    wrong_arch = _serve("--target", str(gpt2_like), "--draft", "none")
    assert wrong_arch.returncode == 1
    assert f"error: model {str(gpt2_like)!r}: architecture GPT2LMHeadModel" in wrong_arch.stderr
    wrong_vocab = _serve("--target", str(tiny_paths["llama"]), "--draft", str(other_vocab))
    assert wrong_vocab.returncode == 1 and "incompatible tokenizers" in wrong_vocab.stderr
    for result in (wrong_arch, wrong_vocab):
        assert "Traceback" not in result.stderr and "Ray" not in result.stderr + result.stdout
