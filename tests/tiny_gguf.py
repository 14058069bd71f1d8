"""Write a tiny Llama model (specdec.core.tiny) as a GGUF file with the `gguf` package.

transformers reads GGUF but does not write it, so this does what llama.cpp's
``convert_hf_to_gguf.py`` does for a Llama: the config as ``llama.*`` keys, the byte-level
tokenizer as a ``gpt2`` vocabulary, the tensors under GGUF names in float32 (exact, so the
loaded model is the folder's model), and the q/k rows permuted the way llama.cpp stores them
(transformers' GGUF loader undoes it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: interleaved rotary halves
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_llama_gguf(folder: str | Path, out: str | Path) -> Path:
    """The Llama model in ``folder`` (config, safetensors, tokenizer.json) as the GGUF ``out``."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cfg = model.config
    assert cfg.model_type == "llama", cfg.model_type
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _LAYER_TENSORS.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = _permute(w, cfg.num_attention_heads)
            elif gg == "attn_k":
                w = _permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)
