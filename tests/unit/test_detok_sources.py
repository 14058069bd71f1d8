"""The router's local tokenizer (`target.tokenizer`, router/detok.py) takes every model source the
workers take (specdec.core.model_source, docs/models.md): a folder, a pulled hub id, a .gguf with a
tokenizer.json beside it; a source whose tokenizer is not here fails with what to do instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from router.detok import Detokenizer, TokenizerNotFound, resolve_model_dir
from specdec.core.model_source import HUB_MARKER, hub_snapshot_dir, ref_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"
VOCAB = {"[UNK]": 0, "hello": 1, "world": 2}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    return root


def _model_folder(folder: Path, with_tokenizer: bool = True) -> Path:
    """A model folder as far as the router reads it: config.json and (or not) a tokenizer.json."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if with_tokenizer:
        tok = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
        tok.pre_tokenizer = Whitespace()
        (folder / "tokenizer.json").write_text(tok.to_str())
    return folder


def _pulled(repo: str, revision: str) -> Path:
    """A complete hub snapshot in the cache, laid out as `specdec models pull` leaves it."""
    folder = _model_folder(hub_snapshot_dir(repo, COMMIT))
    (folder / HUB_MARKER).write_text(json.dumps({"repo": repo, "commit": COMMIT}))
    ref = ref_file(repo, revision)
    ref.parent.mkdir(parents=True)
    ref.write_text(COMMIT)
    return folder


def test_a_pulled_hub_id_resolves_to_its_snapshot(cache: Path) -> None:
    folder = _pulled("acme/tiny", "main")
    assert resolve_model_dir("acme/tiny@main") == folder
    assert resolve_model_dir(f"acme/tiny@{COMMIT}") == folder  # a commit pins itself
    assert Detokenizer.for_model("acme/tiny@main").vocab() == VOCAB


def test_a_folder_and_a_gguf_beside_a_tokenizer_resolve(cache: Path, tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "model")
    (folder / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_dir(str(folder)) == folder
    assert resolve_model_dir(folder / "model.gguf") == folder


def test_a_hub_id_not_pulled_names_the_pull(cache: Path) -> None:
    with pytest.raises(TokenizerNotFound, match=r"specdec models pull acme/tiny@main"):
        resolve_model_dir("acme/tiny@main")


def test_a_hub_id_without_a_revision_is_refused(cache: Path) -> None:
    _pulled("acme/tiny", "main")
    with pytest.raises(TokenizerNotFound, match="no revision"):
        resolve_model_dir("acme/tiny")


def test_a_gguf_alone_says_to_ask_the_target(cache: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "alone" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    with pytest.raises(TokenizerNotFound, match="leave target.tokenizer unset"):
        resolve_model_dir(gguf)


def test_a_folder_without_a_tokenizer_is_refused(cache: Path, tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "bare", with_tokenizer=False)
    with pytest.raises(TokenizerNotFound, match="no tokenizer.json"):
        resolve_model_dir(folder)
