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

from specdec.core import cpu_attention, cpu_rows
from specdec.core.attention import (
    CPU_GEMM_BLOCK,
    CUDA_GEMM_BLOCK,
    gemm_rows,
    hidden_keys_bias,
    invariant_attention,
    padded_span,
    padding_rule_holds,
)
from specdec.core.cpu_gemm import activation_dtype
from specdec.core.fused import fuse
from specdec.core.layer_ops import rms_norm, rotary, silu
from specdec.core.packed import PackedWeight, packing_supported
from specdec.core.quant import Int8Weight, Weight, int8_supported, linear, pack_weight, quantize_int8
from specdec.core.ragged_batch import RaggedBatch
from specdec.core.static_step import StaticSteps

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


class RunnerError(RuntimeError):
    pass


class SlotsExhausted(RunnerError):
    pass


class ContextFull(RunnerError):
    pass


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
    # q, k and v as one GEMM, and gate and up, where that keeps every output's bits (fused.py);
    # the forward then multiplies by these, and the parts stay as they were (tp.py reshards them).
    qkv: Weight | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: Weight | None = None

    def quantize(self) -> None:
        for name in MATRICES:
            setattr(self, name, quantize_int8(getattr(self, name)))

    def pack(self) -> None:
        qkv = fuse([self.q, self.k, self.v], [self.q_bias, self.k_bias, self.v_bias])
        mlp = fuse([self.gate, self.up], [None, None])
        self.qkv, self.qkv_bias = qkv or (None, None)
        self.gate_up = mlp[0] if mlp else None
        joined = (("q", "k", "v") if qkv else ()) + (("gate", "up") if mlp else ())
        for name in MATRICES:
            if name not in joined:
                setattr(self, name, pack_weight(getattr(self, name)))


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
        invariant_numerics: bool = True,
        pack_weights: bool = True,
        static_shapes: bool | None = None,
        static_max_width: int = 16,
    ):
        """`weight_quant="int8"` and `vocab_subset` (the token ids the lm_head may produce) make a
        cheaper drafter; logits of tokens outside the subset come back as -inf. Never use them on
        a target: its outputs must not change. `invariant_numerics` is the default of `forward`'s
        `invariant`: a target needs it for lossless greedy and seeded output in every dtype; a
        drafter does not (its numbers may change), and int8 weights are never invariant.
        `pack_weights`: dense CPU weights are laid out once for oneDNN (specdec/core/packed.py).
        `static_shapes` (default: on a GPU only) runs decode and verify batches of rows up to
        `static_max_width` tokens at bucketed static shapes, which `capture` turns into CUDA graphs
        (specdec/core/static_step.py)."""
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
        # Rows per weight GEMM in the invariant forward (None: one GEMM over all rows; see attention.py).
        self.gemm_block: int | None = CUDA_GEMM_BLOCK if self.device.type == "cuda" else None
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

        self.invariant_numerics = invariant_numerics and not any(isinstance(w.q, Int8Weight) for w in self.layers)
        self.act_dtype = activation_dtype(self.device, self.dtype, self.invariant_numerics)
        self.packed = False
        if pack_weights:
            self.pack_weights()
        else:
            self._check_padding_rule()
        if self.device.type == "cpu":  # built (or found) at start-up, not in a request's first forward
            cpu_rows.kernel()
            cpu_attention.kernel()
        if static_shapes is None:
            static_shapes = self.device.type == "cuda"
        self.static: StaticSteps | None = None
        self.static_max_width = static_max_width if static_shapes else 0  # 0: static shapes off
        self.alloc_kv_cache()
        self.lengths = [0] * num_slots
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        # Slots holding a token tree past their chain (specdec/core/tree_forward.py): slot ->
        # (the chain's length, each stored node's parent).
        self.trees: dict[int, tuple[int, list[int]]] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def _weights(self) -> list[torch.Tensor | PackedWeight]:
        """The weights the invariant forward multiplies by (int8 ones never run invariant)."""
        found = [getattr(layer, n) for layer in self.layers for n in MATRICES] + [self.lm_head]
        return [w for w in found if isinstance(w, torch.Tensor | PackedWeight)]

    def pack_weights(self) -> None:
        """Lay the dense weights out for oneDNN where it can (again after tp.py reshaped them);
        then check the invariant forward's padding rule on weights as the forward uses them."""
        if packing_supported(self.device, self.dtype):
            for layer in self.layers:
                layer.pack()
            self.lm_head = pack_weight(self.lm_head)
            self.packed = True
        self._check_padding_rule()

    def _check_padding_rule(self) -> None:
        if self.device.type == "cpu" and not padding_rule_holds(self._weights(), self.dtype, self.packed):
            self.gemm_block = CPU_GEMM_BLOCK

    def alloc_kv_cache(self) -> None:
        """Empty K and V caches for every slot at the current ``num_kv_heads`` (specdec.core.tp
        calls it again after sharding the heads). Whole key blocks: the invariant attention reads
        past max_len up to the next block boundary. With static shapes, one slot more: the scratch
        slot (index ``num_slots``, never handed out) that a static step's padding writes its keys
        and values to. The static steps are made anew: graphs captured over the old cache and
        weights would write to memory no longer in use."""
        extra = 1 if self.static_max_width else 0
        shape = (len(self.layers), self.num_slots + extra, self.num_kv_heads, padded_span(self.max_len), self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.act_dtype, device=self.device)
        if self.static_max_width:
            self.static = StaticSteps(self, self.static_max_width)

    def capture(self) -> dict:
        """On a GPU, capture a CUDA graph of every static bucket (start-up, after any tensor-parallel
        sharding); elsewhere nothing. Returns what was captured (`StaticSteps.capture`)."""
        return self.static.capture() if self.static is not None else self.captured

    @property
    def captured(self) -> dict:
        """What `capture` captured: {buckets: [{batch, width, span, invariant}], seconds, bytes};
        empty lists and zeros where nothing was (a CPU, static shapes off, tensor parallelism)."""
        return self.static.captured if self.static is not None else {"buckets": [], "seconds": 0.0, "bytes": 0}

    def capture_summary(self) -> dict:
        """{graphs, seconds, bytes} of `captured`: what a worker's Info (WorkerInfo.captured) and the
        GPU check report."""
        c = self.captured
        return {"graphs": len(c["buckets"]), "seconds": float(c["seconds"]), "bytes": int(c["bytes"])}

    # ---- slots -------------------------------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free.pop()
        self.trees.pop(slot, None)
        self.lengths[slot] = 0
        self.slot_tokens[slot] = []
        return slot

    def free_slot(self, slot: int) -> None:
        if slot in self._free:
            raise RunnerError(f"slot {slot} is already free")
        self.trees.pop(slot, None)
        self.lengths[slot] = 0
        self.slot_tokens[slot] = []
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything after the first `length` tokens of the slot (no copy, no recompute)."""
        if not 0 <= length <= self.lengths[slot] or length > self.trees.get(slot, (length, []))[0]:
            raise RunnerError(f"cannot roll slot {slot} back to {length} (length {self.lengths[slot]})")
        self.trees.pop(slot, None)
        self.lengths[slot] = length
        del self.slot_tokens[slot][length:]

    def common_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` already in the slot's cache."""
        cached = self.slot_tokens[slot]
        n = min(len(cached), len(tokens), self.trees.get(slot, (len(cached), []))[0])  # a tree is no prefix
        if cached[:n] == list(tokens[:n]):  # the usual case, compared in C: a Python loop over a long
            return n  # context costs about 6x (docs/results.md, "Small costs behind rules in the code")
        i = 0
        while i < n and cached[i] == tokens[i]:
            i += 1
        return i

    # ---- forward -------------------------------------------------------------------------------
    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the token embedding for `ids`, in the dtype the layers compute in."""
        return F.embedding(ids, self.embed).to(self.act_dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x

    @torch.inference_mode()
    def forward(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        num_logits: int | Sequence[int] = 1,
        invariant: bool | None = None,
    ) -> list[torch.Tensor]:
        """Append `tokens[b]` to slot `slots[b]` and return logits [num_logits_b, vocab] per row.

        Rows may have different lengths and different cache lengths (prefill, decode and verify
        mixed in one batch). `num_logits` counts positions from the end of each row; 0 skips the
        lm_head for that row (e.g. a prefill whose logits are not needed). `invariant` (default: the
        runner's `invariant_numerics`) makes every token's logits and KV bitwise independent of the
        rest of the forward: its row's length, the other rows, padding.
        """
        invariant = self.invariant_numerics if invariant is None else invariant
        n_logits, lens, starts = _check_rows(self, slots, tokens, num_logits)
        if self.static is not None and self.static.fits(lens):
            # Decode and verify: bucketed static shapes, each row's numbers as below (static_step.py).
            logits = self.static.run(slots, tokens, lens, starts, n_logits, invariant)
        else:
            logits = self._eager(
                RaggedBatch.plan(self, slots, tokens, n_logits, lens, starts, invariant), tokens, invariant
            )
        for slot, row, start in zip(slots, tokens, starts):
            self.lengths[slot] = start + len(row)
            self.slot_tokens[slot].extend(int(t) for t in row)
        return logits

    def _eager(self, batch: RaggedBatch, tokens: Sequence[Sequence[int]], invariant: bool) -> list[torch.Tensor]:
        """The forward at the batch's own shapes: prefill, and whatever the static buckets do not hold."""
        dev, n, rows = self.device, batch.tokens, batch.rows
        ids = torch.zeros(rows, dtype=torch.long)
        ids[:n] = torch.as_tensor([t for row in tokens for t in row], dtype=torch.long)
        ids = ids.to(dev)
        positions = torch.zeros(rows, dtype=torch.long, device=dev)
        positions[:n] = batch.pack(batch.positions)
        write_slot = batch.slot_t.repeat_interleave(batch.lens_t)
        # The compiled loop on a CPU takes a fast forward's attention too: it reads the cache in place,
        # where SDPA's call costs more than its arithmetic at a decode step's few queries.
        compiled = cpu_attention.runs_on(dev)
        bias = hidden_keys_bias(batch.query_positions, padded_span(batch.span)) if invariant or compiled else None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k_cache[i][write_slot, :, positions[:n]] = k[:n]
            self.v_cache[i][write_slot, :, positions[:n]] = v[:n]
            attn = self._attention(i, q[:n], batch, bias)
            return F.pad(attn, (0, 0, 0, rows - n)) if rows > n else attn

        x = self._layers(self.embedding(ids), positions, invariant, attend)
        ends = [at + length for at, length in zip(batch.offsets, batch.lens)]
        picked = [i for end, k in zip(ends, batch.num_logits) for i in range(end - k, end)]
        return self._logits(x, picked, batch.num_logits, invariant)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        invariant: bool,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The decoder layers over packed rows x [rows, hidden] at `positions` [rows]. `attend(layer,
        q, k, v)` stores the new keys and values and returns the attention [rows, heads * head_dim]:
        the eager and the static forward differ only there, so every other operation is one code."""
        cos, sin = self.rotary(x, positions.clamp_max(self.max_len - 1)[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [rows, 1, D]
        rows, d = x.shape[0], self.head_dim
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, self.eps, invariant)
            if w.qkv is None:
                parts = ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias))
                q, k, v = (self._linear(h, m, b, invariant) for m, b in parts)
            else:
                sizes = [w.q.shape[0], w.k.shape[0], w.v.shape[0]]
                q, k, v = self._linear(h, w.qkv, w.qkv_bias, invariant).split(sizes, -1)
            q, k, v = q.view(rows, -1, d), k.view(rows, -1, d), v.view(rows, -1, d)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            x = x + self._reduce(self._linear(attend(i, q, k, v), w.o, None, invariant))
            h = rms_norm(x, w.post_norm, self.eps, invariant)
            if w.gate_up is None:
                gate, up = self._linear(h, w.gate, None, invariant), self._linear(h, w.up, None, invariant)
            else:
                gate, up = self._linear(h, w.gate_up, None, invariant).chunk(2, -1)
            act = silu(gate, invariant)
            x = x + self._reduce(self._linear(act * up, w.down, None, invariant))
        return x

    def _linear(self, x: torch.Tensor, w, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
        """x [M, in] @ w; the invariant forward runs it in blocks of `gemm_block` rows where set."""
        if not (invariant and self.gemm_block):
            return linear(x, w, bias)
        m, size = x.shape[0], self.gemm_block
        x = F.pad(x, (0, 0, 0, -m % size))
        if m <= size:  # one block (every decode step of up to `size` tokens): no concatenation
            return linear(x, w, bias)[:m]
        return torch.cat([linear(block, w, bias) for block in x.split(size)])[:m]

    def _attention(self, layer: int, q: torch.Tensor, batch: RaggedBatch, bias: torch.Tensor | None) -> torch.Tensor:
        """Attention of the packed queries q [n, H, D] over their rows' caches; returns [n, H*D].
        With `bias` (from `hidden_keys_bias`), the invariant attention (on a CPU, the compiled loop);
        without, SDPA."""
        b, width = len(batch.slots), batch.width
        q = batch.unpack(q).transpose(1, 2)  # [B, H, width, D]
        span = batch.span if bias is None else bias.shape[-1]
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if bias is not None:  # the rows' slots: read in place on a CPU (cpu_attention.c), gathered elsewhere
            out = invariant_attention(q, kc, vc, bias, self.head_dim**-0.5, slots=batch.slot_t)
        else:
            if b == 1:  # a view, no copy
                keys, vals = kc[batch.slots[0], :, :span].unsqueeze(0), vc[batch.slots[0], :, :span].unsqueeze(0)
            else:
                keys, vals = kc[batch.slot_t, :, :span], vc[batch.slot_t, :, :span]
            mask = None
            if not (b == 1 and width == 1):
                mask = (torch.arange(span, device=self.device) <= batch.positions[:, :, None])[:, None]
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])
        return batch.pack(out.transpose(1, 2).reshape(b, width, -1))

    def _logits(self, x: torch.Tensor, picked: list[int], num_logits: list[int], invariant: bool) -> list[torch.Tensor]:
        """Logits of the rows `picked` of x, split `num_logits` per batch row. Only the requested
        positions go through the final norm and the (large) lm_head, in the eager forward and after
        a static step alike."""
        if not picked:
            return [x.new_empty(0, self.vocab_size, dtype=torch.float32) for _ in num_logits]
        h = x[torch.tensor(picked, device=self.device)]
        if invariant:
            h = F.pad(h, (0, 0, 0, gemm_rows(len(picked), self.dtype) - len(picked)))
        logits = self._head(h, invariant)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        logits = logits[: len(picked)].float()
        if self.vocab_ids is not None:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self.vocab_ids] = logits
            logits = full
        return list(torch.split(logits, num_logits))

    def _head(self, h: torch.Tensor, invariant: bool) -> torch.Tensor:
        """The final norm and the lm_head (this rank's vocabulary slice), in the model's dtype."""
        return self._linear(rms_norm(h, self.final_norm, self.eps, invariant), self.lm_head, None, invariant)


def _check_rows(
    runner: ModelRunner, slots: Sequence[int], tokens: Sequence[Sequence[int]], num_logits: int | Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Refuse a forward before it changes anything; return each row's logit count, length and start."""
    batch = len(slots)
    if batch == 0 or batch != len(tokens):
        raise RunnerError("forward needs one token list per slot and at least one row")
    if len(set(slots)) != batch:
        raise RunnerError("a slot appears twice in one batch")
    n_logits = [num_logits] * batch if isinstance(num_logits, int) else list(num_logits)
    lens = [len(t) for t in tokens]
    starts = [runner.lengths[s] for s in slots]
    for slot, start, n, k in zip(slots, starts, lens, n_logits):
        if slot in runner.trees:
            raise RunnerError(f"slot {slot} holds a token tree: keep a path or roll back first")
        if n == 0:
            raise RunnerError(f"slot {slot}: empty token list")
        if start + n > runner.max_len:
            raise ContextFull(f"slot {slot}: {start} + {n} tokens exceed the context of {runner.max_len}")
        if not 0 <= k <= n:
            raise RunnerError(f"slot {slot}: num_logits {k} outside [0, {n}]")
    if min(min(row) for row in tokens) < 0 or max(max(row) for row in tokens) >= runner.vocab_size:
        raise RunnerError(f"token ids must be in [0, {runner.vocab_size})")
    return n_logits, lens, starts
