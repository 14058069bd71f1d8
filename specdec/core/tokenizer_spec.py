"""What a router needs of the target's tokenizer, without the model files.

The target worker exports its tokenizer (``tokenizer.json``, chat template, special and EOS ids)
through ``TargetService.GetTokenizer``; the router rebuilds its detokenizer from that, so the head
node holds no weights. Draft and target must speak the same token ids: both workers publish a
fingerprint of their vocabulary (token -> id, added tokens included), and the router compares them.
The fingerprint covers exactly what :func:`specdec.core.build.check_compatible` compares (the
vocabulary), so the router and the single-process engine accept the same pairs.

No torch here: the router imports this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["TokenizerSpec", "vocab_fingerprint", "export_tokenizer"]


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """``sha256:<hex>`` of the vocabulary, independent of dict order and of the file's formatting."""
    canon = json.dumps(sorted((str(t), int(i)) for t, i in vocab.items()), ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as it travels to the router (the GetTokenizer answer)."""

    tokenizer_json: str  # the Rust `tokenizers` serialisation
    fingerprint: str  # vocab_fingerprint of the vocabulary
    chat_template: str = ""  # Jinja chat template; empty when the model has none
    special_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    clean_up_tokenization_spaces: bool = False  # transformers' decode clean-up switch


def export_tokenizer(tokenizer, eos_token_ids: Iterable[int] = ()) -> TokenizerSpec:
    """A transformers *fast* tokenizer -> TokenizerSpec (a slow one has no tokenizer.json)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: it has no tokenizer.json to export")
    template = getattr(tokenizer, "chat_template", None)
    return TokenizerSpec(
        tokenizer_json=backend.to_str(),
        fingerprint=vocab_fingerprint(tokenizer.get_vocab()),
        chat_template=template if isinstance(template, str) else "",
        special_token_ids=sorted(int(i) for i in getattr(tokenizer, "all_special_ids", ())),
        eos_token_ids=sorted(int(i) for i in eos_token_ids),
        clean_up_tokenization_spaces=bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)),
    )
