"""Random-weight models of real shapes, built from configs in code: the GPU machines have no model
files and no network, so the checks that time or compare forwards build what they need here.

The shapes are the published configs' (hidden size, layers, heads, vocabulary, RoPE); the weights
are transformers' own random initialisation under a fixed seed, so two builds on one device are
the same model. ``tiny=True`` keeps the architecture and shrinks every size, for the CPU runs of the
same scripts (tests).
"""

from __future__ import annotations

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE |= {"original_max_position_embeddings": 8192}

SHAPES: dict[str, tuple[str, dict]] = {  # name: (architecture, config fields)
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
            tie_word_embeddings=True,
        ),
    ),
}

# The same architectures at toy sizes (a target pair keeps one vocabulary, as a real pair does).
TINY_VOCAB = 512
_TINY = {
    "qwen2.5-1.5b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "qwen2.5-0.5b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
    "llama-3.1-8b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "llama-3.2-1b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
}


def config(name: str, tiny: bool = False, layers: int | None = None):
    from transformers import LlamaConfig, Qwen2Config

    arch, fields = SHAPES[name]
    fields = dict(fields)
    if tiny:
        fields |= _TINY[name] | {"vocab_size": TINY_VOCAB, "num_key_value_heads": 1}
        fields.pop("head_dim", None)
    if layers:
        fields["num_hidden_layers"] = layers
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, tie_word_embeddings=False, **fields)
    return LlamaConfig(**fields)


def build(name: str, dtype, device: str = "cpu", tiny: bool = False, layers: int | None = None, seed: int = 0):
    """The model ``name`` (a key of :data:`SHAPES`) with random weights, in eval mode, on ``device``
    (created there: an 8B model is never copied through host memory)."""
    from transformers import AutoModelForCausalLM

    from specdec.core.models import parse_dtype

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config(name, tiny, layers), dtype=parse_dtype(dtype)).eval()


def word_tokenizer(vocab_size: int):
    """A fast tokenizer with one word per id ("t0" ... "t{n-1}"): what a service needs of a
    tokenizer (a vocabulary to fingerprint, a tokenizer.json to export, a decode) for a model
    whose real tokenizer is not on the machine. No EOS: random models run to ``max_tokens``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
