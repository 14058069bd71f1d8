"""Checking models before any worker starts: an architecture the runner supports, and a draft
whose tokenizer speaks the target's token ids (docs/models.md, Checks).

Both read only the model's metadata (config.json or the GGUF header; the tokenizer files), never
its weights: ``serve`` runs them in the launching process (cluster/launch.py) so a wrong model
fails in a second with its name and what is wrong, not as a worker crash minutes later. No torch
here: the launching process need not load it.
"""

from __future__ import annotations

import json

from specdec.core.model_source import ModelSourceError, local_files
from specdec.core.tokenizer_spec import vocab_fingerprint

__all__ = ["ModelCheckError", "RUNNER_MODEL_TYPES", "check_architecture", "check_models", "tokenizer_fingerprint"]

# model_type -> the transformers class the runner drives (specdec.core.runner.SUPPORTED_ARCHS;
# tests/unit/test_model_check.py keeps the two lists equal).
RUNNER_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class ModelCheckError(ModelSourceError):
    """A model the service cannot run, or a draft that cannot draft for the target."""


def _config(spec: str) -> dict:
    """The model's config as a dict: config.json, or a GGUF's header keys mapped to config names."""
    folder, gguf_file = local_files(spec)
    if gguf_file is None:
        try:
            return json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelCheckError(f"model {spec!r}: cannot read its config.json: {exc}") from exc
    import gguf

    try:
        reader = gguf.GGUFReader(str(folder / gguf_file))
    except Exception as exc:  # noqa: BLE001 - a truncated file fails deep in the reader (IndexError, ...)
        raise ModelCheckError(f"model {spec!r}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    return {"model_type": arch, "architectures": None}


def check_architecture(spec: str) -> None:
    """Raise ModelCheckError unless the runner supports the model's architecture."""
    cfg = _config(spec)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or [RUNNER_MODEL_TYPES.get(model_type, model_type)]
    supported = sorted(RUNNER_MODEL_TYPES.values())
    if model_type not in RUNNER_MODEL_TYPES or any(a not in supported for a in archs):
        raise ModelCheckError(
            f"model {spec!r}: architecture {', '.join(map(str, archs))} (model_type {model_type!r}) is not "
            f"supported by the runner; supported: {', '.join(supported)} (Llama- and Qwen2-like models)"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelCheckError(f"model {spec!r}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise ModelCheckError(f"model {spec!r}: sliding-window attention is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelCheckError(f"model {spec!r}: biases on o_proj or the MLP are not supported")


def tokenizer_fingerprint(spec: str) -> str:
    """:func:`vocab_fingerprint` of the model's tokenizer, as its worker will publish it."""
    folder, gguf_file = local_files(spec)
    if gguf_file is None and (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        # what transformers' fast tokenizer's get_vocab() returns, without loading transformers
        return vocab_fingerprint(Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True))
    from transformers import AutoTokenizer  # a GGUF's or a slow tokenizer: built as the worker builds it

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelCheckError(f"model {spec!r}: cannot load its tokenizer: {exc}") from exc
    return vocab_fingerprint(tokenizer.get_vocab())


def check_models(target: str, draft: str | None) -> None:
    """Both models supported, and the draft (a model, not 'ngram' or none) on the target's vocabulary."""
    check_architecture(target)
    if draft is None or draft.lower() in ("", "none", "off", "ngram"):
        return
    check_architecture(draft)
    if tokenizer_fingerprint(draft) != tokenizer_fingerprint(target):
        raise ModelCheckError(
            f"draft {draft!r} and target {target!r} have incompatible tokenizers (their vocabularies differ): "
            "a draft must propose the target's token ids; use a draft of the same model family, or 'ngram'"
        )
