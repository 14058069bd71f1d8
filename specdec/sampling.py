"""Sampling parameters, logit processing and the sampling primitives shared by drafters and verifiers.

Everything here is pure (no model, no I/O) and runs the same on CPU and GPU tensors.

Two kinds of randomness are used (DESIGN.md invariant 2):

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
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# torch and numpy are imported inside the functions that use them, so SamplingParams and
# InvalidParams (and the torch-free parts of verify, stops and ngram) can be imported by the router,
# which never imports torch (DESIGN.md, rules of the house).
if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "InvalidParams",
    "SamplingParams",
    "process_logits",
    "make_generator",
    "gumbel_noise",
    "sample_token",
    "sparse_topk",
    "sample_sparse",
    "draw_uniforms",
    "draw_from_probs",
]

_U64 = 2**64
# top_p looks at the 256, then 4096 most likely tokens, and sorts the whole row only when their
# mass is still below top_p (rare with real LMs): a full sort of V ~ 150k costs ~5 ms per row.
_TOP_P_SIZES = (256, 4096)


class InvalidParams(ValueError):
    """A request parameter is out of range; ``field`` names it (mapped to INVALID_ARGUMENT at the edge)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # picklable across processes (Ray actors re-raise pickled exceptions)
        return (type(self), (self.field, self.message))


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or getattr(getattr(x, "dtype", None), "kind", None) == "b"


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not _is_bool(x)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not _is_bool(x)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    ``stop`` and ``stop_token_ids`` accept any sequence (lists from JSON/protobuf) and are
    stored as tuples so the object stays hashable; a bare string ``stop="x"`` means ``("x",)``.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(
        self, vocab_size: int | None = None, max_context: int | None = None, prompt_len: int = 0
    ) -> None:
        """Raise :class:`InvalidParams` naming the first bad field and its allowed range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParams("max_tokens", f"must be an integer >= 1 (got {self.max_tokens!r})")
        if max_context is not None:
            if prompt_len >= max_context:
                raise InvalidParams(
                    "prompt",
                    f"prompt has {prompt_len} tokens; the model's context is {max_context} tokens, "
                    "which leaves no room to generate",
                )
            if prompt_len + self.max_tokens > max_context:
                raise InvalidParams(
                    "max_tokens",
                    f"must be in [1, {max_context - prompt_len}]: prompt ({prompt_len} tokens) + "
                    f"max_tokens ({self.max_tokens}) exceeds the model's context of {max_context}",
                )
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParams("temperature", f"must be a finite number >= 0 (got {self.temperature!r})")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidParams("top_p", f"must be in (0, 1] (got {self.top_p!r})")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidParams("top_k", f"must be an integer >= 0, 0 = off (got {self.top_k!r})")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < _U64)):
            raise InvalidParams("seed", f"must be an integer in [0, 2**64) (got {self.seed!r})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParams("stop", f"stop strings must be non-empty strings (got {s!r})")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                upper = f"{vocab_size})" if vocab_size is not None else "vocab_size)"
                raise InvalidParams("stop_token_ids", f"ids must be in [0, {upper} (got {t!r})")
        if not _is_bool(self.ignore_eos):
            raise InvalidParams("ignore_eos", f"must be a boolean (got {self.ignore_eos!r})")


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
        vals = (
            torch.topk(probs, n, dim=-1).values
            if n < v
            else torch.sort(probs, dim=-1, descending=True).values
        )
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
    before rounding to float32.  No cache: ~1 ms for V = 151,936 on one CPU core.
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


def sample_token(
    logprobs_row: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    position: int | None = None,
    invariant: bool | None = None,
) -> int:
    """Sample one token from a processed log-prob row (output of :func:`process_logits`).

    * greedy: argmax of the row;
    * invariant (default when ``params.seed`` is set): argmax(row + gumbel_noise(seed, position))
      — the Gumbel-max trick, an exact sample from softmax(row), reproducible from (seed, position);
    * otherwise: inverse-CDF sample with a uniform from ``generator``.
    """
    import torch

    if params.greedy:
        return int(torch.argmax(logprobs_row).item())
    if invariant is None:
        invariant = params.seed is not None
    if invariant:
        if params.seed is None or position is None:
            raise ValueError("invariant sampling needs params.seed and the absolute position")
        noise = gumbel_noise(params.seed, position, logprobs_row.shape[-1], device=logprobs_row.device)
        return int(torch.argmax(logprobs_row.float() + noise).item())
    (u,) = draw_uniforms(1, generator)
    return draw_from_probs(logprobs_row.double().exp(), u)


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
