"""Logit processing and the sampling primitives shared by drafters and verifiers.

Everything here is pure (no model, no I/O) and runs the same on CPU and GPU tensors.

Two kinds of randomness are used (docs/design.md, invariant 2):

* a ``torch.Generator`` (CPU) for rejection sampling: verifier acceptance tests and the
  drafter's own samples.  Uniforms are always drawn on the CPU generator and applied by
  inverse CDF on whatever device the probabilities live on, so one code path serves both.
* ``gumbel_noise(seed, position, V)``: Gumbel(0, 1) noise that is a pure function of
  (seed, absolute position).  It is produced by NumPy's Philox4x64 counter-based bit generator
  keyed by the 128-bit key (seed, position); NumPy guarantees the raw bit stream of a bit
  generator is stable across versions, so the noise does not depend on batch, k, drafter,
  torch version or which worker computes it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

# torch and numpy are imported inside the functions that use them (a habit kept from when the
# request parameters lived here; the router now imports specdec.core.params, which is torch-free).
if TYPE_CHECKING:
    import torch

from specdec.core.params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "process_logits",
    "make_generator",
    "gumbel_noise",
    "sparse_topk",
    "sample_sparse",
    "draw_uniforms",
    "draw_from_probs",
]

_U64 = 2**64  # seeds are taken modulo 2**64
# top_p looks at the 256, then 4096 most likely tokens, and sorts the whole row only when their
# mass is still below top_p (rare with real LMs): a full sort of a 150k vocabulary is slow
# (docs/results.md, "Small costs behind rules in the code").
_TOP_P_SIZES = (256, 4096)


# --------------------------------------------------------------------------------------------
# Logit processing
# --------------------------------------------------------------------------------------------


def _top_p_mask(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (-inf) tokens outside the nucleus of softmax(x), keeping the smallest top set whose mass
    reaches ``top_p`` (the token crossing top_p is kept).

    The cut is made by *value* (keep p >= p_cut), so tokens tied at the boundary are all kept and
    the result does not depend on how a sort orders ties, on the batch shape, or on which of the
    candidate sizes below computed it (their cumulative sums agree on the common prefix).
    """
    import torch

    probs = torch.softmax(x, dim=-1)
    v = probs.shape[-1]
    for n in (*(m for m in _TOP_P_SIZES if m < v), v):
        vals = torch.topk(probs, n, dim=-1).values if n < v else torch.sort(probs, dim=-1, descending=True).values
        cum = vals.double().cumsum(dim=-1)
        if n == v or not bool((cum[..., -1] < top_p).any()):
            break
    idx = (cum < top_p).sum(dim=-1, keepdim=True).clamp_(max=n - 1)
    cut = vals.gather(-1, idx)
    return x.masked_fill(probs < cut, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 log-probabilities after temperature, top_k and top_p (masked entries are -inf).

    Greedy requests get ``log_softmax`` of the raw logits.  Rows are processed independently and
    identically whatever the leading shape, so a row gives bit-identical output alone or in a batch
    (required by invariant-mode sampling).  Does not modify ``logits``.
    """
    import torch

    x = logits.float()
    if params.greedy:
        return torch.log_softmax(x, dim=-1)
    # Subtract the row max before dividing so a tiny temperature cannot overflow to inf/nan.
    x = (x - x.amax(dim=-1, keepdim=True)) / float(params.temperature)
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties at the k-th value are all kept
    if params.top_p < 1.0:
        x = _top_p_mask(x, float(params.top_p))
    return torch.log_softmax(x, dim=-1)


# --------------------------------------------------------------------------------------------
# Randomness
# --------------------------------------------------------------------------------------------


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator; seeded deterministically when ``seed`` is given, from OS entropy otherwise."""
    import torch

    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) % _U64)
    return g


def gumbel_noise(
    seed: int, position: int, vocab_size: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``[vocab_size]`` (float32), a pure function of (seed, position).

    Philox4x64 keyed by (seed, position) gives 64-bit words; the top 53 bits make
    u in (0, 1) exactly representable in float64, and g = -log(-log u) is computed in float64
    before rounding to float32.  No cache: it is cheap next to a forward (docs/results.md, "Small costs
    behind rules in the code").
    """
    import numpy as np
    import torch

    if seed < 0 or position < 0:
        raise ValueError(f"gumbel_noise needs seed >= 0 and position >= 0 (got {seed}, {position})")
    key = np.array([int(seed) % _U64, int(position) % _U64], dtype=np.uint64)
    raw = np.random.Philox(key=key).random_raw(vocab_size)
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)  # in (0, 1), never 0 or 1
    g = -np.log(-np.log(u))
    out = torch.from_numpy(g.astype(np.float32))
    return out if device is None else out.to(device)


def draw_uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """``n`` independent U[0, 1) floats from a CPU generator (the global RNG when None)."""
    import torch

    if n <= 0:
        return []
    return torch.rand(n, generator=generator, dtype=torch.float64).tolist()


def draw_from_probs(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from a 1-D non-negative (not necessarily normalised) weight vector.

    With u ~ U[0, 1) the index i is returned with probability probs[i] / sum(probs); an index of
    zero weight is never returned.  Works on any device (one host sync).
    """
    import torch

    cdf = probs.double().cumsum(dim=0)
    total = cdf[-1]
    target = (total * u).reshape(1)
    idx = int(torch.searchsorted(cdf, target, right=True).item())
    if idx >= probs.shape[0]:  # u * total rounded up to total: take the last index with weight
        idx = int(torch.nonzero(probs > 0).flatten()[-1].item())
    return idx


def sparse_topk(logprobs_row: torch.Tensor, K: int) -> tuple[list[int], list[float]]:
    """The drafter's top-K truncated, renormalised distribution as (ids, probs).

    ids are ordered by decreasing probability; tokens of zero probability (masked, -inf) are
    dropped, so fewer than K entries may come back.  The probs are float32-representable (safe to
    ship as protobuf ``float``) and sum to 1 up to float32 rounding; :func:`sample_sparse` and the
    verifier both renormalise by the sum, so the distribution the drafter samples from is exactly
    the one the verifier uses.
    """
    import torch

    if K < 1:
        raise ValueError(f"K must be >= 1 (got {K})")
    row = logprobs_row.float().flatten()
    vals, ids = torch.topk(row, min(K, row.shape[0]))
    keep = torch.isfinite(vals)
    vals, ids = vals[keep].double(), ids[keep]
    if vals.numel() == 0:
        raise ValueError("sparse_topk: the row has no token of non-zero probability")
    probs = torch.softmax(vals, dim=0).float()
    return ids.tolist(), probs.tolist()


def sample_sparse(ids: list[int], probs: list[float], generator: torch.Generator | None) -> int:
    """Draw one id from a sparse distribution (normalised by its sum), as the rejection verifier assumes."""
    (u,) = draw_uniforms(1, generator)
    total = math.fsum(probs)
    target = u * total
    acc = 0.0
    last = None
    for tok, pr in zip(ids, probs):
        if pr <= 0:
            continue
        acc += pr
        last = tok
        if target < acc:
            return int(tok)
    if last is None:
        raise ValueError("sample_sparse: empty distribution")
    return int(last)
