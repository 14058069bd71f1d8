"""The invariant attention by query tiles gives every query the bits of one pass over the whole span.

`invariant_attention_torch` (specdec/core/attention.py, the GPU's path) takes QUERY_TILE query positions at a time over
only the key blocks they see, and folds the per-block sums one block at a time. The reference below
is the plain form it replaces: every query over the whole padded span, the per-block sums scanned
with cumsum. Both must agree bit for bit on every shape (batch, width, span, GQA group, float32 and
bf16, one and two threads), or chunked prefill would change a prompt's KV and greedy output
(docs/design.md, invariant 2). Deliberately broken folds show the comparison can fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import specdec.core.attention as attention
from specdec.core.attention import (
    KEY_BLOCK,
    MIN_GEMM_ROWS,
    QUERY_TILE,
    hidden_keys_bias,
    invariant_attention_torch,
    padded_span,
    query_width,
)


def whole_span_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Every query over every key block of the span, the block sums combined by cumsum."""
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group, blocks = heads // kv_heads, span // KEY_BLOCK
    rows = group * width
    qf = (q.float() * scale).reshape(batch, kv_heads, rows, dim)
    scores = torch.matmul(qf, keys.float().transpose(-1, -2))
    scores = scores.view(batch, kv_heads, group, width, span) + bias
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights.view(batch, kv_heads, rows, blocks, KEY_BLOCK)
    total = weights.sum(-1).cumsum(-1)[..., -1:]
    vf = values.float().view(batch, kv_heads, blocks, KEY_BLOCK, dim)
    out = torch.matmul(weights.transpose(2, 3), vf).cumsum(2)[:, :, -1] / total
    return out.view(batch, heads, width, dim).to(q.dtype)


def _block_weights(q, keys, bias, scale):
    """The softmax numerators [B, Hkv, rows, blocks, KEY_BLOCK] the broken variants below sum wrongly."""
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group, blocks = heads // kv_heads, span // KEY_BLOCK
    qf = (q.float() * scale).reshape(batch, kv_heads, group * width, dim)
    scores = torch.matmul(qf, keys.float().transpose(-1, -2)).view(batch, kv_heads, group, width, span) + bias
    return torch.exp(scores - scores.amax(-1, keepdim=True)).view(batch, kv_heads, group * width, blocks, KEY_BLOCK)


def float32_fold(q, keys, values, bias, scale):
    """Broken on purpose: the per-block sums folded in float32 rather than as cumsum does."""
    batch, heads, width, dim = q.shape
    kv_heads, blocks = keys.shape[1], keys.shape[2] // KEY_BLOCK
    rows = heads // kv_heads * width
    weights = _block_weights(q, keys, bias, scale)
    acc = torch.zeros(batch, kv_heads, rows, dim)
    for j in range(blocks):
        acc = acc + torch.matmul(weights[:, :, :, j], values.float()[:, :, j * KEY_BLOCK : (j + 1) * KEY_BLOCK])
    return (acc / weights.sum((-1, -2))[..., None]).view(batch, heads, width, dim).to(q.dtype)


def pairwise_blocks(q, keys, values, bias, scale):
    """Broken on purpose: the block sums added as a tree (torch.sum) rather than in key order."""
    batch, heads, width, dim = q.shape
    kv_heads, blocks = keys.shape[1], keys.shape[2] // KEY_BLOCK
    weights = _block_weights(q, keys, bias, scale)
    vf = values.float().view(batch, kv_heads, blocks, KEY_BLOCK, dim)
    out = torch.matmul(weights.transpose(2, 3), vf).sum(2) / weights.sum((-1, -2))[..., None]
    return out.view(batch, heads, width, dim).to(q.dtype)


# (batch, heads, kv heads, new tokens, longest cache before them): decodes, verifies, prefill chunks
# deep into a long prompt, one forward over a long prompt (several tiles), GQA groups 1, 3, 4.
SHAPES = [
    (1, 9, 3, 1, 0),
    (4, 9, 3, 1, 1000),
    (2, 9, 3, 6, 100),
    (3, 8, 2, 5, 500),
    (1, 4, 4, 300, 40),
    (2, 12, 4, 130, 700),
    (1, 9, 3, 128, 3872),
    (2, 9, 3, 128, 2000),
    (1, 9, 3, 1500, 0),
]


def case(batch: int, heads: int, kv_heads: int, new: int, start: int, dtype: torch.dtype, seed: int = 0, starts=None):
    gen = torch.Generator().manual_seed(seed)
    width = query_width(new, heads, kv_heads)
    if starts is None:
        starts = torch.randint(0, start + 1, (batch,), generator=gen)
        starts[0] = start  # one row at the longest cache; the others shorter: keys hidden from them
    else:
        starts = torch.tensor(starts)
    span = padded_span(start + width)
    q = (torch.randn(batch, heads, width, 64, generator=gen) * 3).to(dtype)
    keys = (torch.randn(batch, kv_heads, span, 64, generator=gen) * 3).to(dtype)
    values = torch.randn(batch, kv_heads, span, 64, generator=gen).to(dtype)
    bias = hidden_keys_bias(starts[:, None] + torch.arange(width)[None], span)
    return q, keys, values, bias


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def agree(fn: Callable, args) -> bool:
    return torch.equal(bits(fn(*args, 0.125)), bits(whole_span_reference(*args, 0.125)))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}-kv{}-t{}-at{}".format(*s))
def test_tiles_give_every_query_the_whole_span_bits(shape, dtype, threads):
    assert agree(invariant_attention_torch, case(*shape, dtype))


@pytest.mark.parametrize("one_call", [0, 1 << 40], ids=["block-by-block", "one-batched-call"])
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[6:7], ids=lambda s: "b{}-h{}-kv{}-t{}-at{}".format(*s))
def test_both_ways_of_summing_the_blocks_give_the_same_bits(shape, one_call, monkeypatch):
    """`_attend` sums small per-block sums in one batched GEMM and cumsum, large ones block by block
    (ONE_CALL_ELEMENTS): the same left fold in float64, so either way the reference's bits."""
    monkeypatch.setattr(attention, "ONE_CALL_ELEMENTS", one_call)
    assert agree(invariant_attention_torch, case(*shape, torch.bfloat16))
    assert agree(invariant_attention_torch, case(*shape, torch.float32))


def test_the_long_cases_take_several_tiles_and_skip_hidden_blocks():
    """The shapes above reach what the tiles change: a forward wider than one tile, whose first
    tile sees fewer key blocks than the span holds."""
    batch, heads, kv_heads, new, start = SHAPES[-1]
    width = query_width(new, heads, kv_heads)
    assert width > 2 * QUERY_TILE and padded_span(QUERY_TILE) < padded_span(start + width)
    assert (heads // kv_heads * QUERY_TILE) % MIN_GEMM_ROWS == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_rows_far_apart_each_go_over_their_own_keys_with_the_same_bits(dtype, monkeypatch):
    """A chunk deep into one prompt beside another prompt's first chunk: the short row attends over
    its own key blocks, not the long row's span, and every query's numbers stay the whole span's."""
    from specdec.core import attention

    spans = []
    attend = attention._attend
    monkeypatch.setattr(
        attention, "_attend", lambda qf, kf, vf, bias: spans.append(kf.shape[2]) or attend(qf, kf, vf, bias)
    )
    args = case(2, 9, 3, 128, 3000, dtype, starts=[3000, 40])
    assert agree(invariant_attention_torch, args)
    assert sorted(spans) == [padded_span(40 + 128), padded_span(3000 + 128)]
    spans.clear()
    close = case(2, 9, 3, 128, 3000, dtype, starts=[3000, 2900])  # close together: one batched call
    assert agree(invariant_attention_torch, close) and spans == [padded_span(3000 + 128)]


def test_cumsum_is_a_float64_left_fold():
    """What the fold in `_attend` copies: torch's CPU cumsum of float32 sums in float64 in order."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 63, 8, generator=gen) * torch.logspace(-4, 4, 63)[None, :, None]
    acc = torch.zeros(6, 8, dtype=torch.float64)
    for j in range(63):
        acc += x[:, j]
    assert torch.equal(bits(x.cumsum(1)[:, -1]), bits(acc.float()))
    left32 = torch.zeros(6, 8)
    for j in range(63):
        left32 = left32 + x[:, j]
    assert not torch.equal(bits(x.cumsum(1)[:, -1]), bits(left32))


@pytest.mark.parametrize("broken", [float32_fold, pairwise_blocks], ids=["float32-fold", "pairwise"])
def test_a_fold_in_another_order_or_precision_is_caught(broken):
    args = case(1, 9, 3, 128, 3872, torch.float32)
    assert agree(invariant_attention_torch, args)
    assert not agree(broken, args)
