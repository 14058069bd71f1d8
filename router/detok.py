"""Detokenisation for the router: the target's ``tokenizer.json`` through the `tokenizers` library.

The router applies stop strings and builds text (docs/design.md, invariant 5), so it needs to turn token
ids into text exactly as the target's transformers tokenizer does (``decode(ids,
skip_special_tokens=True)``), without transformers or torch. A fast tokenizer's ``decode`` *is*
the Rust ``tokenizers`` decode, plus an optional clean-up of spaces before punctuation that
``tokenizer_config.json`` may switch on; both are reproduced here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["Detokenizer", "resolve_model_dir", "TokenizerNotFound"]


class TokenizerNotFound(FileNotFoundError):
    pass


def resolve_model_dir(spec: str | Path) -> Path:
    """The local folder holding a model's ``tokenizer.json``, for any model source whose files are on
    this machine (docs/models.md): a prepared pack, a folder, a pulled hub id ``ORG/NAME@REVISION``,
    or a .gguf file with a tokenizer.json beside it. Resolved by :mod:`specdec.core.model_source`
    (torch-free, offline), as the workers resolve the same string.
    """
    from specdec.core.model_source import local_files
    from specdec.core.packs import PackError

    s = str(spec)
    path = Path(s).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path  # a tokenizer-only folder is enough here (no config.json needed)
    try:
        folder, gguf_file = local_files(s)
    except PackError as err:  # not prepared, not pulled, or no model at all: say which and how
        raise TokenizerNotFound(f"target tokenizer {s!r}: {err}") from err
    if (folder / "tokenizer.json").is_file():
        return folder
    if gguf_file is not None:
        raise TokenizerNotFound(
            f"target tokenizer {s!r}: a GGUF file holds its tokenizer inside, which the router reads only "
            "through the target: leave target.tokenizer unset (the router then asks the target for it) "
            "or name a folder or hub id with tokenizer.json"
        )
    raise TokenizerNotFound(
        f"target tokenizer {s!r}: no tokenizer.json in {folder} (the router decodes text with the target's "
        "tokenizer; leave target.tokenizer unset to ask the target for it)"
    )


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class Detokenizer:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerNotFound(f"{path} does not exist")
        cleanup = False
        cfg = self.model_dir / "tokenizer_config.json"
        if cfg.is_file():
            try:
                cleanup = bool(json.loads(cfg.read_text()).get("clean_up_tokenization_spaces", False))
            except (OSError, ValueError):
                log.warning("could not read %s; no space clean-up", cfg)
        self._load(path.read_text(encoding="utf-8"), cleanup)

    def _load(self, tokenizer_json: str, cleanup: bool) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json)
        self._cleanup = cleanup

    @classmethod
    def from_json(cls, tokenizer_json: str, clean_up_tokenization_spaces: bool = False) -> Detokenizer:
        """From a tokenizer.json's text (the target's GetTokenizer answer): no model files needed."""
        self = cls.__new__(cls)
        self.model_dir = None
        self._load(tokenizer_json, clean_up_tokenization_spaces)
        return self

    @classmethod
    def for_model(cls, spec: str | Path) -> Detokenizer:
        return cls(resolve_model_dir(spec))

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._cleanup else text

    def encode(self, text: str) -> list[int]:
        """Tokenize like ``tokenizer(text)`` (special tokens added by the post-processor)."""
        return list(self._tok.encode(text).ids)
