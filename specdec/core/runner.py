"""Batched model runner over a per-slot KV cache with rollback.

One implementation serves the draft worker, the target worker and the single-process engine. It
takes its weights from a transformers Llama/Qwen2 model and runs prefill, single-token decode and
multi-token verify for a ragged batch in one forward. The KV cache is allocated once for
`num_slots` x `max_len` tokens; a request owns a slot, and rolling back rejected tokens only
rewinds the slot's length.

Tensor parallelism is a transform on this runner (specdec/core/tp.py): it shards the per-layer
weights (q/k/v/gate/up by output rows, o/down by input columns), divides the head counts, and sets
the hooks `all_reduce` (sums the partial outputs of o_proj and down_proj across ranks) and
`gather_logits` (joins the vocabulary slices of a split lm_head).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.core.quant import Int8Weight, int8_supported, linear, quantize_int8

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


class RunnerError(RuntimeError):
    pass


class SlotsExhausted(RunnerError):
    pass


class ContextFull(RunnerError):
    pass


Weight = torch.Tensor | Int8Weight
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LayerWeights:
    q: Weight
    q_bias: torch.Tensor | None
    k: Weight
    k_bias: torch.Tensor | None
    v: Weight
    v_bias: torch.Tensor | None
    o: Weight
    gate: Weight
    up: Weight
    down: Weight
    input_norm: torch.Tensor
    post_norm: torch.Tensor

    def quantize(self) -> None:
        for name in MATRICES:
            setattr(self, name, quantize_int8(getattr(self, name)))


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _layer_weights(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        q=attn.q_proj.weight.detach(),
        q_bias=_bias(attn.q_proj),
        k=attn.k_proj.weight.detach(),
        k_bias=_bias(attn.k_proj),
        v=attn.v_proj.weight.detach(),
        v_bias=_bias(attn.v_proj),
        o=attn.o_proj.weight.detach(),
        gate=mlp.gate_proj.weight.detach(),
        up=mlp.up_proj.weight.detach(),
        down=mlp.down_proj.weight.detach(),
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
    )


def _check_supported(model) -> None:
    config = model.config
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHS:
        raise RunnerError(f"{arch} is not supported by ModelRunner (supported: {SUPPORTED_ARCHS})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise RunnerError(f"hidden_act {config.hidden_act!r} is not supported")
    if getattr(config, "use_sliding_window", False):
        raise RunnerError("sliding-window attention is not supported")
    layer = model.model.layers[0]
    if layer.self_attn.o_proj.bias is not None or any(
        getattr(layer.mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")
    ):
        raise RunnerError("biases on o_proj or the MLP are not supported")


class ModelRunner:
    """Runs a Llama/Qwen2 model over a slot-based KV cache.

    `forward(slots, tokens)` appends each row's tokens to its slot (at the slot's current length)
    and returns logits for the last `num_logits` positions of each row (float32).
    """

    def __init__(
        self,
        model,
        num_slots: int = 8,
        max_len: int = 2048,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        weight_quant: str | None = None,
        vocab_subset: Sequence[int] | None = None,
    ):
        """`weight_quant="int8"` and `vocab_subset` (the token ids the lm_head may produce) make a
        cheaper drafter; logits of tokens outside the subset come back as -inf. Never use them on
        a target: its outputs must not change."""
        _check_supported(model)
        config = model.config
        self.config = config
        self.vocab_size = config.vocab_size
        self.num_slots, self.max_len = num_slots, max_len
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.all_reduce = all_reduce
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

        base = model.model
        self.embed = base.embed_tokens.weight.detach()
        self.layers = [_layer_weights(layer) for layer in base.layers]
        self.final_norm = base.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.rotary = base.rotary_emb  # HF's own module: handles every RoPE scaling variant
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.vocab_ids: torch.Tensor | None = None
        if vocab_subset is not None:
            self.vocab_ids = torch.as_tensor(sorted(set(vocab_subset)), dtype=torch.long, device=self.device)
            self.lm_head = self.lm_head[self.vocab_ids].contiguous()
        if weight_quant == "int8" and int8_supported(self.device, self.dtype):
            for layer in self.layers:
                layer.quantize()
            self.lm_head = quantize_int8(self.lm_head)
        elif weight_quant not in (None, "none", "int8"):
            raise RunnerError(f"weight_quant must be None or 'int8', got {weight_quant!r}")

        shape = (len(self.layers), num_slots, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.lengths = [0] * num_slots
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))

    # ---- slots -------------------------------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        self.slot_tokens[slot] = []
        return slot

    def free_slot(self, slot: int) -> None:
        if slot in self._free:
            raise RunnerError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self.slot_tokens[slot] = []
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything after the first `length` tokens of the slot (no copy, no recompute)."""
        if not 0 <= length <= self.lengths[slot]:
            raise RunnerError(f"cannot roll slot {slot} back to {length} (length {self.lengths[slot]})")
        self.lengths[slot] = length
        del self.slot_tokens[slot][length:]

    def common_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` already in the slot's cache."""
        cached = self.slot_tokens[slot]
        n = min(len(cached), len(tokens))
        i = 0
        while i < n and cached[i] == tokens[i]:
            i += 1
        return i

    # ---- forward -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF's RMSNorm: normalise in float32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x

    @torch.inference_mode()
    def forward(
        self, slots: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: int | Sequence[int] = 1
    ) -> list[torch.Tensor]:
        """Append `tokens[b]` to slot `slots[b]` and return logits [num_logits_b, vocab] per row.

        Rows may have different lengths and different cache lengths (prefill, decode and verify
        mixed in one batch). `num_logits` counts positions from the end of each row; 0 skips the
        lm_head for that row (e.g. a prefill whose logits are not needed).
        """
        batch = len(slots)
        if batch == 0 or batch != len(tokens):
            raise RunnerError("forward needs one token list per slot and at least one row")
        if len(set(slots)) != batch:
            raise RunnerError("a slot appears twice in one batch")
        n_logits = [num_logits] * batch if isinstance(num_logits, int) else list(num_logits)
        lens = [len(t) for t in tokens]
        starts = [self.lengths[s] for s in slots]
        for slot, start, n, k in zip(slots, starts, lens, n_logits):
            if n == 0:
                raise RunnerError(f"slot {slot}: empty token list")
            if start + n > self.max_len:
                raise ContextFull(f"slot {slot}: {start} + {n} tokens exceed the context of {self.max_len}")
            if not 0 <= k <= n:
                raise RunnerError(f"slot {slot}: num_logits {k} outside [0, {n}]")
        width = max(lens)
        dev = self.device

        ids = torch.zeros(batch, width, dtype=torch.long)
        for b, row in enumerate(tokens):
            ids[b, : lens[b]] = torch.as_tensor(row, dtype=torch.long)
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise RunnerError(f"token ids must be in [0, {self.vocab_size})")
        ids = ids.to(dev)
        start_t = torch.tensor(starts, dtype=torch.long, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        offsets = torch.arange(width, device=dev)
        positions = start_t[:, None] + offsets[None, :]  # [B, T]
        valid = offsets[None, :] < lens_t[:, None]  # [B, T]
        span = max(s + n for s, n in zip(starts, lens))  # keys to attend over

        # Cache write indices for the real (non-padding) tokens.
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        write_slot = slot_t[:, None].expand(batch, width)[valid]
        write_pos = positions[valid]

        mask = None
        if not (batch == 1 and width == 1):
            keys = torch.arange(span, device=dev)
            mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
            mask = mask[:, None]  # broadcast over heads
        contiguous_single = batch == 1

        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x, positions.clamp_max(self.max_len - 1))
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        d = self.head_dim
        for i, w in enumerate(self.layers):
            h = self._rms(x, w.input_norm)
            q = linear(h, w.q, w.q_bias).view(batch, width, -1, d).transpose(1, 2)
            k = linear(h, w.k, w.k_bias).view(batch, width, -1, d).transpose(1, 2)
            v = linear(h, w.v, w.v_bias).view(batch, width, -1, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[write_slot, :, write_pos] = k.transpose(1, 2)[valid]
            vc[write_slot, :, write_pos] = v.transpose(1, 2)[valid]
            if contiguous_single:
                keys_i, vals_i = kc[slots[0], :, :span].unsqueeze(0), vc[slots[0], :, :span].unsqueeze(0)
            else:
                keys_i, vals_i = kc[slot_t, :, :span], vc[slot_t, :, :span]
            attn = F.scaled_dot_product_attention(
                q, keys_i, vals_i, attn_mask=mask, enable_gqa=q.shape[1] != keys_i.shape[1]
            )
            attn = attn.transpose(1, 2).reshape(batch, width, -1)
            x = x + self._reduce(linear(attn, w.o))
            h = self._rms(x, w.post_norm)
            x = x + self._reduce(linear(F.silu(linear(h, w.gate)) * linear(h, w.up), w.down))

        for slot, row, start in zip(slots, tokens, starts):
            self.lengths[slot] = start + len(row)
            self.slot_tokens[slot].extend(int(t) for t in row)

        # Only the requested positions go through the final norm and the (large) lm_head.
        rows = [(b, lens[b] - k, lens[b]) for b, k in enumerate(n_logits) if k]
        if not rows:
            return [x.new_empty(0, self.vocab_size, dtype=torch.float32) for _ in range(batch)]
        picked = torch.cat([x[b, lo:hi] for b, lo, hi in rows])
        logits = linear(self._rms(picked, self.final_norm), self.lm_head)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        logits = logits.float()
        if self.vocab_ids is not None:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self.vocab_ids] = logits
            logits = full
        out, at = [], 0
        for k in n_logits:
            out.append(logits[at : at + k])
            at += k
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
