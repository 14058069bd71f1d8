"""Target-only sampling of one token: the tests' reference for what speculation must reproduce."""

from __future__ import annotations

import torch

from specdec.core.params import SamplingParams
from specdec.core.sampling import draw_from_probs, draw_uniforms, gumbel_noise


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
