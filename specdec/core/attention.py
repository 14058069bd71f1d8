"""Attention whose result for a query does not depend on the rest of the forward.

torch's scaled_dot_product_attention picks its kernel and its blocking from the shapes of the call:
the same query gets different bf16 (and float32) outputs in a 1-token decode, inside a k+1-token
verify, next to a longer row, or over a padded key span (`scripts/invariance.py ops` shows which). Greedy
speculative decoding is lossless only if it does not (docs/design.md, invariant 2), so this computes
attention with explicit reductions whose order is fixed by construction:

* scores are one float32 GEMM per kv head (each a dot product over the head dim), the weighted
  sum of values a float32 GEMM per block of KEY_BLOCK keys, both over a multiple of MIN_GEMM_ROWS
  query rows (see `query_width`); float64 on CUDA (`invariant_dtype`);
* the softmax subtracts the exact maximum over the visible keys (a max is order-free);
* the per-block partial sums are combined by a sequential fold over blocks in key order, so the
  blocks past a query's own position add exact zeros and change nothing (and are skipped).

That is `invariant_attention_torch`, a GPU's path. A CPU runs specdec/core/cpu_attention.c instead:
the same rules in one compiled loop, which reads the cache directly and needs no padding rule (so a
row's queries go in as they are: `attention_width`). There every runner's forward takes it, a
drafter's fast one too: at a decode step's few queries SDPA's call costs more than its arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from specdec.core import cpu_attention
from specdec.core.packed import pack
from specdec.core.quant import linear

KEY_BLOCK = 64
# Query positions the invariant attention takes at a time: each tile reads only the key blocks its
# queries see, so one forward over a long prompt skips the hidden half of the square.
QUERY_TILE = 256
# Per-block sums of values (float32 on a CPU) up to this many elements are made by one batched GEMM
# and folded by cumsum; more (a CPU prefill chunk's) are folded block by block as they are made.
# The two give the same bits (tests/unit/test_attention_tiles.py).
ONE_CALL_ELEMENTS = 1 << 20
# A CPU GEMM rounds a row according to the block of rows it is computed in (`scripts/invariance.py
# ops`). float32 (MKL): a block of 4 rows one way, a remainder of 1-3 rows another; several
# threads split the rows in blocks of 4, so only an M that is a multiple of 4 rounds every row the
# same way. bf16 (oneDNN): M = 1 one way, every M >= 2 the other (measured with 1 to 16 threads).
# A batch's rows go over their own key spans (not the longest row's) from this many GEMM rows per
# kv head on: a prefill chunk's, not a decode step's, whose few rows cost more in calls than in keys.
SPLIT_MIN_ROWS = 64
MIN_GEMM_ROWS = 4  # float32, and the attention (whose GEMMs are float32 whatever the model dtype)
MIN_BF16_GEMM_ROWS = 2
# A CUDA GEMM (cuBLAS) picks its kernel, and with it how a row is rounded, by the whole shape: on an
# H100, a bf16 row of Qwen2.5-1.5B's down projection rounds one way at M <= 88 and another beyond,
# float32 rows change at M = 2, 9, 12, 17, ... (`scripts/gpu_check.py`; docs/results.md, "On a GPU").
# The invariant forward runs each CUDA weight GEMM over blocks of exactly this many rows, so every
# row gets one kernel.
CUDA_GEMM_BLOCK = 64
# The CPU rule above is the BLAS's, so it is measured, not assumed: on an Intel Xeon with AMX (torch
# 2.13) a float32 row of SmolLM2's down projection rounds one way at M = 16-56 and another at
# 57-192, and a bf16 row of its up projection changes past M = 32.
# Where `padding_rule_holds` finds that, the CPU runs weight GEMMs in blocks of exactly this many rows
# too (every row then gets one kernel, whatever its position: checked there as well).
CPU_GEMM_BLOCK = 16
_PROBE_ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 32, 33, 56, 57, 64, 65, 128, 192, 200)
_PROBE_MAX_OUT = 16384  # larger weights (lm_heads) are left out of the probe: too costly to time
_PROBE_SHAPES = ((1536, 576), (576, 1536))  # SmolLM2's MLP, where the AMX machine breaks the rule
_RULE_HOLDS: dict[tuple, bool] = {}


def gemm_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows to run a GEMM of `rows` rows over so that each row is rounded as in any other M."""
    if dtype == torch.bfloat16:
        return max(rows, MIN_BF16_GEMM_ROWS)
    return max(1, -(-rows // MIN_GEMM_ROWS)) * MIN_GEMM_ROWS


def padding_rule_holds(weights: Iterable, dtype: torch.dtype, packed: bool = False) -> bool:
    """Whether `gemm_rows`' padding gives a row the same numbers in every CPU GEMM on this machine,
    with the current threads, for the shapes of ``weights`` (and a few common ones): every row
    count it pads to gives a row the same result, and so does every position in the largest.
    ``packed``: with weights in oneDNN's layout (specdec/core/packed.py), as the runner has them.
    Cached per dtype, threads, layout and shapes (a few hundred small GEMMs the first time)."""
    shapes = {tuple(w.shape) for w in weights if w.shape[0] <= _PROBE_MAX_OUT} | set(_PROBE_SHAPES)
    key = (dtype, torch.get_num_threads(), packed, tuple(sorted(shapes)))
    if key not in _RULE_HOLDS:
        _RULE_HOLDS[key] = all(_rule_holds_for(n, k, dtype, packed) for n, k in sorted(shapes))
    return _RULE_HOLDS[key]


def _rule_holds_for(n: int, k: int, dtype: torch.dtype, packed: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    w = pack(w) if packed else w
    row = torch.randn(1, k, generator=gen).to(dtype)
    counts = sorted({gemm_rows(m, dtype) for m in _PROBE_ROWS})
    others = torch.randn(counts[-1], k, generator=gen).to(dtype)
    want = linear(torch.cat([row, others[: counts[0] - 1]]), w)[0]
    for m in counts[1:]:
        if not torch.equal(linear(torch.cat([row, others[: m - 1]]), w)[0], want):
            return False
    same = linear(row.expand(counts[-1], k).contiguous(), w)  # one row at every position
    return bool((same == same[0]).all())


def padded_span(span: int) -> int:
    """Keys a forward attends over: `span` rounded up to whole key blocks."""
    return -(-span // KEY_BLOCK) * KEY_BLOCK


def query_width(width: int, num_heads: int, num_kv_heads: int) -> int:
    """Query positions per row (>= width) so that a kv head's score GEMM, which holds
    num_heads // num_kv_heads heads of every position, has a multiple of MIN_GEMM_ROWS rows."""
    group = num_heads // num_kv_heads
    step = MIN_GEMM_ROWS // math.gcd(group, MIN_GEMM_ROWS)
    return -(-width // step) * step


def attention_width(width: int, num_heads: int, num_kv_heads: int, device: torch.device) -> int:
    """Query positions per row that `invariant_attention` is given on `device`: the row's own width
    where the compiled loop runs (one query at a time, no padding rule), else `query_width`."""
    return width if cpu_attention.runs_on(device) else query_width(width, num_heads, num_kv_heads)


def invariant_dtype(device: torch.device) -> torch.dtype:
    """What the invariant forward computes its attention and RMS norms in: float32 on a CPU, whose
    kernels round a row the same way at the shapes `gemm_rows` and `query_width` give (tested here);
    float64 on CUDA, where a float32 batched GEMM rounds a row by the batch's size (a decode row
    beside 7 others differed from the same row alone by 2.4e-4, and a random Llama-3.1-8B shape's
    verify logits from its decodes by up to 0.27) and a row's norm by the rows beside it. The rows
    that float64 kernels round differently differ by about 1e-16 of their size, which the cast to
    float32 and then to the model's dtype does not see: with it every verify and decode logit was
    bitwise equal (docs/results.md, "On a GPU")."""
    return torch.float64 if device.type == "cuda" else torch.float32


def hidden_keys_bias(positions: torch.Tensor, span: int) -> torch.Tensor:
    """[B, 1, 1, T, span] float32: 0 where key j <= positions[b, t] (visible), -inf elsewhere.
    Made once per forward and shared by the layers."""
    keys = torch.arange(span, device=positions.device)
    hidden = keys[None, None, :] > positions[:, :, None]
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=positions.device).masked_fill_(hidden, float("-inf"))
    return bias[:, None, None]


def invariant_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries over a row's cached keys, the same for a query in any forward.

    q: [B, H, T, D]; keys, values: [B, Hkv, S, D], or with ``slots`` [B] a whole cache layer
    [slots, Hkv, >= S, D] of which batch row b reads slot slots[b]; bias: from `hidden_keys_bias`,
    [B, 1, 1, T, S] with S a multiple of KEY_BLOCK. Returns [B, H, T, D] in q's dtype. torch's
    path needs (H // Hkv) * T to be a multiple of MIN_GEMM_ROWS (see `query_width`).

    On a CPU, the compiled loop of specdec/core/cpu_attention.c where it can be built: its own fixed
    order of arithmetic, the cache read in place, 1.3-2.5x faster than torch's ops there
    (docs/results.md, "The CPU engine"). Elsewhere `invariant_attention_torch`, the slots' keys
    gathered first. A process takes one of the two for all its forwards."""
    span = bias.shape[-1]
    compiled = cpu_attention.supports(q)
    _check_shapes(q, keys.shape[1], span, compiled)
    if compiled:
        return cpu_attention.attend(q, keys, values, bias, scale, slots)
    if slots is not None:
        keys, values = keys[slots, :, :span], values[slots, :, :span]
    return invariant_attention_torch(q, keys, values, bias, scale)


def _check_shapes(q: torch.Tensor, kv_heads: int, span: int, compiled: bool) -> None:
    group, width = q.shape[1] // kv_heads, q.shape[2]
    if span % KEY_BLOCK or (not compiled and (group * width) % MIN_GEMM_ROWS):
        raise ValueError(
            f"invariant_attention: span {span} must be a multiple of {KEY_BLOCK} and "
            f"(H/Hkv)*T = {group * width} a multiple of {MIN_GEMM_ROWS}"
        )


def invariant_attention_torch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """`invariant_attention` as torch ops (a GPU's, and a CPU's without a C compiler).

    The queries go QUERY_TILE positions at a time, each tile over the key blocks its queries can see:
    the blocks left out hold only hidden keys, whose weights are exact zeros, so a query's numbers are
    those of one pass over the whole span (tests/unit/test_attention_tiles.py compares them bit for bit).
    """
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    _check_shapes(q, kv_heads, span, compiled=False)
    if batch > 1 and q.device.type == "cpu" and group * width >= SPLIT_MIN_ROWS:
        # Rows of a batch far apart (a chunk deep into one prompt beside the first of another) each
        # go over their own keys: the blocks left out are hidden from them, so their numbers are the
        # same (as for tiles), and the batch does not pay the longest row's span for every row.
        # A host read, so CPU only; decode rows are too few for it to pay (docs/results.md, §6).
        own = [min(span, padded_span(int(n))) for n in (bias[:, 0, 0] == 0).sum(-1).amax(-1).tolist()]
        if 4 * sum(own) <= 3 * batch * span:  # a quarter of the batch's key blocks or more hidden
            return torch.cat(
                [
                    invariant_attention_torch(
                        q[b : b + 1], keys[b : b + 1, :, :s], values[b : b + 1, :, :s], bias[b : b + 1, ..., :s], scale
                    )
                    for b, s in enumerate(own)
                ]
            )
    # Head h uses kv head h // group (transformers' repeat_kv): fold the group into the GEMM rows.
    acc = invariant_dtype(q.device)
    qf = (q.to(acc) * scale).reshape(batch, kv_heads, group, width, dim)
    kf, vf = keys.to(acc), values.to(acc)
    if width <= QUERY_TILE:  # decode, verify, a chunk: one tile, no host read (a CUDA graph captures it)
        return _attend(qf, kf, vf, bias).view(batch, heads, width, dim).to(q.dtype)
    # Keys each query position sees in any row (a prefix of the span), read once from the bias.
    seen = (bias[:, 0, 0] == 0).sum(-1).amax(0).tolist()
    out = torch.empty(batch, kv_heads, group, width, dim, dtype=acc, device=q.device)
    for t0 in range(0, width, QUERY_TILE):
        t1 = min(width, t0 + QUERY_TILE)  # a multiple of MIN_GEMM_ROWS rows, as `width` is
        tile_span = min(span, padded_span(max(seen[t0:t1])))
        out[:, :, :, t0:t1] = _attend(
            qf[:, :, :, t0:t1], kf[:, :, :tile_span], vf[:, :, :tile_span], bias[..., t0:t1, :tile_span]
        )
    return out.view(batch, heads, width, dim).to(q.dtype)


def _attend(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """One tile: qf [B, Hkv, group, t, D] scaled, over kf, vf [B, Hkv, S, D], all in
    `invariant_dtype`."""
    batch, kv_heads, group, width, dim = qf.shape
    span = kf.shape[2]
    rows, blocks = group * width, span // KEY_BLOCK
    # A score is one dot product over D: the GEMM's N (the span) does not change how it is summed.
    scores = torch.matmul(qf.reshape(batch, kv_heads, rows, dim), kf.transpose(-1, -2))
    # In place: the same elementwise ops, without two more [rows, span] tensors.
    scores = scores.view(batch, kv_heads, group, width, span).add_(bias)
    weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # exactly 0 for hidden keys
    weights = weights.view(batch, kv_heads, rows, blocks, KEY_BLOCK)
    # CPU cumsum accumulates float32 in float64 (torch's acc_type), one block after another: the last
    # element is this left fold in float64, rounded once (tests/unit/test_attention_tiles.py).
    total = weights.sum(-1).cumsum(-1)[..., -1:]  # [B, Hkv, rows, 1]
    # The sum over keys is a GEMM per block of keys (fixed K), then the same fold over blocks.
    if qf.device.type == "cuda" or batch * kv_heads * blocks * rows * dim <= ONE_CALL_ELEMENTS:
        # Every block's GEMM in one batched call, folded by cumsum: a GPU is bound by launches here.
        parts = torch.matmul(weights.transpose(2, 3), vf.unflatten(2, (blocks, KEY_BLOCK)))
        summed = parts.cumsum(2)[:, :, -1]  # [B, Hkv, rows, D]
    else:  # a CPU prefill chunk: block by block into one accumulator, not tens of MB of block sums
        acc = torch.zeros(batch, kv_heads, rows, dim, dtype=torch.float64, device=qf.device)
        for j in range(blocks):
            acc += torch.matmul(weights[:, :, :, j], vf[:, :, j * KEY_BLOCK : (j + 1) * KEY_BLOCK])
        summed = acc.to(qf.dtype)
    return (summed / total).view(batch, kv_heads, group, width, dim)
