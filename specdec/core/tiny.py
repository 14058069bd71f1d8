"""Tiny random-weight Llama / Qwen2 models with a byte-level tokenizer, saved as ordinary HF folders.

They make the runner and engine tests fast while exercising the same code as real models.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<s>", "</s>", "<pad>"]
BYTE_VOCAB = 256


def _byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 byte tokens + <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(arch: str = "llama", vocab_size: int = BYTE_VOCAB + len(SPECIALS), **overrides):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=BYTE_VOCAB,
        eos_token_id=BYTE_VOCAB + 1,
        pad_token_id=BYTE_VOCAB + 2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, init_std: float = 0.3, **overrides) -> Path:
    """Build a random model from a config and save it (with the byte tokenizer) under `path`.

    A larger-than-usual init std makes the next-token distributions peaked, so greedy decoding has
    clear winners (no float near-ties) and a related draft model gets real acceptance.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(arch, initializer_range=init_std, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)
    return path


def make_tiny_draft(target_path: str | Path, path: str | Path, noise: float = 0.1, seed: int = 1) -> Path:
    """A draft for a tiny target: its weights plus Gaussian noise, so acceptance is high but not 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(path)
    return Path(path)
