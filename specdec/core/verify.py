"""Lossless verification of one speculative round (docs/design.md, invariant 2).

A round for one sequence: the target produced logits for k+1 positions — the last committed
token followed by the k draft tokens — and row j predicts the token at absolute position
``start_pos + j``.  :func:`verify` returns the accepted draft prefix plus exactly one target
token (the correction at the first rejection, or the bonus token after k acceptances).

Modes:

* ``greedy``: accept while draft == argmax(target logits); the first mismatch (or position k)
  contributes the target's argmax.  Token-identical to target-only greedy decoding.
* ``rejection`` (Leviathan et al. 2023; Chen et al. 2023): accept x_j with probability
  min(1, p(x_j) / q(x_j)); on rejection draw from norm(max(0, p - q)) and stop; after k
  acceptances draw the bonus from p.  q is the drafter's sparse top-K distribution, zero outside
  its ids.  A draft without probabilities (n-gram, or a token absent from its own q) is verified
  as a point mass q = delta(x), which is lossless for *any* way of choosing x.
* ``invariant``: the target's token at absolute position i is argmax(logp_i + gumbel(seed, i));
  accept draft tokens while they equal it.  Output is identical to target-only seeded sampling.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from specdec.core.params import InvalidParams, SamplingParams, VerifyMode
from specdec.core.round_types import Draft, SparseDist, VerifyResult
from specdec.core.sampling import draw_from_probs, draw_uniforms, gumbel_noise, process_logits
from specdec.core.token_tree import depths, walk
from specdec.core.tree_sampling import verify_sampled_tree

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["verify", "verify_tree"]


def _check_shapes(target_logits: torch.Tensor, draft: Draft) -> torch.Tensor:
    k = len(draft.tokens)
    if target_logits.dim() == 1 and k == 0:
        target_logits = target_logits.unsqueeze(0)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"verify: expected target logits of shape [k+1, V] = [{k + 1}, V], got {tuple(target_logits.shape)}"
        )
    v = target_logits.shape[1]
    for t in draft.tokens:
        if not 0 <= t < v:
            raise ValueError(f"verify: draft token {t} outside the vocabulary [0, {v})")
    if draft.probs is not None and len(draft.probs) != k:
        raise ValueError(f"verify: draft has {k} tokens but {len(draft.probs)} distributions")
    return target_logits


def _draft_q(draft: Draft, j: int) -> SparseDist:
    """The q to verify position j against: the drafter's sparse distribution, normalised by its
    sum, or a point mass on the drafted token when none (usable) was sent."""
    x = draft.tokens[j]
    if draft.probs is not None:
        ids, probs = draft.probs[j]
        total = math.fsum(probs)
        if total > 0 and all(p >= 0 for p in probs):
            for i, t in zip(ids, probs):
                if i == x and t > 0:
                    return list(ids), [p / total for p in probs]
        logger.warning("draft token %d is not in its own distribution; verifying as a point mass", x)
    return [x], [1.0]


def _residual(p: torch.Tensor, q_ids: list[int], q_probs: list[float]) -> torch.Tensor:
    """max(0, p - q) with q zero outside its ids (not normalised; draw_from_probs normalises).

    Falls back to p when the residual has (numerically) no mass — it cannot be sampled, and p is
    then the right distribution up to rounding.
    """
    import torch

    q = torch.zeros_like(p)
    q[torch.tensor(q_ids, dtype=torch.long, device=p.device)] = torch.tensor(q_probs, dtype=p.dtype, device=p.device)
    r = (p - q).clamp_(min=0)
    if not float(r.sum()) > 1e-12:
        return p
    return r


def verify(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    mode: VerifyMode,
    *,
    start_pos: int,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Verify one sequence's round; see the module docstring.  k = 0 (empty draft) is plain decoding."""
    import torch

    mode = VerifyMode(mode)  # also accepts the plain strings "greedy" / "rejection" / "invariant"
    target_logits = _check_shapes(target_logits, draft)
    k = len(draft.tokens)
    tokens = draft.tokens

    if mode is VerifyMode.GREEDY:
        # argmax of the raw logits: exactly what target-only greedy decoding computes.
        tgt = torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < k and tokens[n] == tgt[n]:
            n += 1
        return VerifyResult(tokens=list(tokens[:n]) + [tgt[n]], num_accepted=n)

    logp = process_logits(target_logits, params)

    if mode is VerifyMode.INVARIANT:
        if params.seed is None:
            raise InvalidParams("verify_mode", "'invariant' verification needs a seed")
        v = logp.shape[-1]
        out: list[int] = []
        for j in range(k + 1):  # noise only up to the first mismatch
            noise = gumbel_noise(params.seed, start_pos + j, v, device=logp.device)
            t = int(torch.argmax(logp[j] + noise).item())
            out.append(t)
            if j == k or t != tokens[j]:
                return VerifyResult(tokens=out, num_accepted=j)
        raise AssertionError("unreachable")

    # One uniform per acceptance test plus one for the final draw (correction or bonus): only one
    # final draw happens per round, so all uniforms used are independent.
    us = draw_uniforms(k + 1, generator)
    if k:
        idx = torch.tensor(tokens, dtype=torch.long, device=logp.device)
        p_at = logp[torch.arange(k, device=logp.device), idx].double().exp().tolist()
    for j in range(k):
        q_ids, q_probs = _draft_q(draft, j)
        qx = q_probs[q_ids.index(tokens[j])]
        if us[j] * qx < p_at[j]:  # accept with probability min(1, p/q)
            continue
        r = _residual(logp[j].double().exp(), q_ids, q_probs)
        y = draw_from_probs(r, us[k])
        return VerifyResult(tokens=list(tokens[:j]) + [y], num_accepted=j)
    y = draw_from_probs(logp[k].double().exp(), us[k])
    return VerifyResult(tokens=list(tokens) + [y], num_accepted=k)


def verify_tree(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    mode: VerifyMode,
    *,
    start_pos: int,
    generator: torch.Generator | None = None,
) -> tuple[VerifyResult, list[int]]:
    """Verify a token tree (``draft.parents``): logits [1 + nodes, V], row 0 after the committed
    tokens, row 1 + i after node i. Returns the verdict and the accepted nodes, root first.

    Greedy and seeded modes: the target's token after any node is a function of its logits (and of
    the position's noise), so accepting the path that matches it gives exactly the tokens
    target-only decoding gives. Rejection mode: a sampled tree, verified by recursive rejection
    with `generator` (specdec/core/tree_sampling.py; docs/design.md, "Token trees")."""
    import torch

    mode = VerifyMode(mode)
    if draft.parents is None or len(draft.parents) != len(draft.tokens):
        raise ValueError("verify_tree: the draft is not a tree")
    if target_logits.dim() != 2 or target_logits.shape[0] != len(draft.tokens) + 1:
        raise ValueError(
            f"verify_tree: expected logits of shape [1 + nodes, V] = [{len(draft.tokens) + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    if mode is VerifyMode.GREEDY:
        tgt = torch.argmax(target_logits, dim=-1).tolist()

        def token_after(node: int) -> int:
            return tgt[node + 1]

    elif mode is VerifyMode.INVARIANT:
        if params.seed is None:
            raise InvalidParams("verify_mode", "'invariant' verification needs a seed")
        logp = process_logits(target_logits, params)
        depth = [0] + depths(draft.parents)
        noise: dict[int, torch.Tensor] = {}

        def token_after(node: int) -> int:
            d = depth[node + 1]
            if d not in noise:
                noise[d] = gumbel_noise(params.seed, start_pos + d, logp.shape[-1], device=logp.device)
            return int(torch.argmax(logp[node + 1] + noise[d]).item())

    else:
        return verify_sampled_tree(process_logits(target_logits, params), draft, generator)
    path, last = walk(draft.tokens, draft.parents, token_after)
    accepted = [draft.tokens[i] for i in path]
    return VerifyResult(tokens=accepted + [last], num_accepted=len(accepted)), path
