"""Greedy drafting of several tokens in one call: each step's argmax is fed back on the device.

A greedy draft model drafts one token per forward, and between two forwards the host reads each
row's pick (a device synchronisation per step) and plans the next forward. After a round's first
forward, though, every step is the same: one token per row, the previous step's argmax. Here those
steps run as one function over the static buffers of a (batch, 1, span) bucket of
specdec/core/static_step.py: the step, the argmax of each row's logits written back into the token
ids, the positions advanced by one, again; the host reads all the picks once at the end. On a GPU
each step replays the bucket's captured graph, and nothing in the loop waits for the host, so a
CUDA graph could record the whole loop too (not done: a graph per number of steps per bucket).

Each step is the static step a forward of those rows would run (at the span bucket of the last
step), so in invariant numerics the picks are bitwise the argmaxes of one forward per token
(tests/unit/test_static_step.py); in the fast numerics a draft's numbers may change anyway (the
target verifies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core.runner import ContextFull, ModelRunner
from specdec.core.static_step import Bucket


def can_draft_greedily(runner: ModelRunner) -> bool:
    """Static shapes on, and no tensor parallelism: the loop runs on this rank alone, while ranks in
    lockstep (specdec/core/lockstep.py) follow `forward` calls only."""
    return runner.static is not None and runner.all_reduce is None and runner.gather_logits is None


@torch.inference_mode()
def greedy_steps(runner: ModelRunner, slots: Sequence[int], first: Sequence[int], steps: int) -> list[list[int]]:
    """Feed `first[b]` to slot `slots[b]`, then its argmax, and so on: `steps` forwards; returns each
    row's `steps` argmaxes. The slots then hold what was fed (`first` and all but the last pick), as
    `runner.forward` would have left them."""
    static = runner.static
    if static is None or len(slots) > static.batches[-1] or steps < 1:
        raise ValueError("greedy_steps needs static shapes, at most the largest batch bucket, and a step")
    starts = [runner.lengths[s] for s in slots]
    if max(starts) + steps > runner.max_len:
        raise ContextFull(f"{steps} greedy steps from {max(starts)} tokens exceed the context of {runner.max_len}")
    bucket = static.bucket_of(len(slots), 1, max(starts) + steps)  # the span the last step needs
    static.runs[bucket] += steps
    static.loops[bucket] += 1
    static.fill(bucket, slots, [[t] for t in first], starts)
    picks = _loop(runner, bucket, steps)[:, : len(slots)].T.tolist()  # the one synchronisation
    for slot, start, token, row in zip(slots, starts, first, picks):
        runner.lengths[slot] = start + steps
        runner.slot_tokens[slot].extend([int(token)] + row[:-1])
    return picks


def _loop(runner: ModelRunner, bucket: Bucket, steps: int) -> torch.Tensor:
    """[steps, batch] argmaxes; fixed shapes, no host synchronisation."""
    static, invariant = runner.static, runner.invariant_numerics
    ids, positions, _, _ = static.views(bucket, invariant)
    batch, rows = bucket.batch, ids.shape[0]
    out = torch.empty(steps, batch, dtype=torch.long, device=runner.device)
    graph = static.graphs.get((bucket, invariant))  # each step replays the bucket's graph where captured
    for j in range(steps):
        if graph is not None:
            graph.replay()
        else:
            static.step(bucket, invariant)
        # The head over every row of the bucket (rows the attention rule pads to, as `_logits`
        # does). argmax takes the first of equal maxima, as over the float32 logits `forward`
        # returns (the model's dtype rounds nothing more); a vocabulary subset maps back to ids.
        pick = runner._head(static.hidden[:rows], invariant)[:batch].argmax(-1)
        if runner.vocab_ids is not None:
            pick = runner.vocab_ids[pick]
        out[j] = pick
        ids[:batch] = pick
        positions[:batch] += 1  # padding rows too: their writes stay in the scratch slot
    return out


__all__ = ["can_draft_greedily", "greedy_steps"]
