"""A ragged forward's padding queries see no key, so the invariant attention does no work for them.

In the [rows, width] layout a short row's positions past its end are padding. Were they to count
on from the row's end, each would attend over the row's keys and beyond (keys the cache holds from
earlier requests): a 150-token prompt beside three decode rows paid for 3 x 149 such queries, and
the forward took 1.40 s against 1.09 s for the prompt alone (docs/results.md, "The CPU engine").
"""

from __future__ import annotations

import torch

from specdec.core import attention
from specdec.core.ragged_batch import RaggedBatch
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf


def test_padding_queries_are_at_minus_one_and_see_no_key(tiny_paths):
    runner = ModelRunner(load_hf(tiny_paths["llama"], dtype=torch.bfloat16), num_slots=3, max_len=64)
    slots = [runner.alloc_slot() for _ in range(3)]
    runner.forward(slots[1:], [[5] * 10, [6] * 20], num_logits=0)
    tokens = [[1] * 7, [2], [3, 4, 5]]
    batch = RaggedBatch.plan(runner, slots, tokens, [1, 1, 1], [7, 1, 3], [0, 10, 20], invariant=True)
    want = torch.full((3, batch.width), -1)
    want[0, :7], want[1, :1], want[2, :3] = torch.arange(7), torch.tensor([10]), torch.arange(20, 23)
    assert torch.equal(batch.query_positions, want)
    bias = attention.hidden_keys_bias(batch.query_positions, 64)
    seen = (bias[:, 0, 0] == 0).sum(-1)
    assert seen[0, :7].tolist() == list(range(1, 8)) and seen[1, 0] == 11 and seen[2, :3].tolist() == [21, 22, 23]
    assert int(seen[want < 0].sum()) == 0


def test_a_full_layout_keeps_its_positions(tiny_paths):
    runner = ModelRunner(load_hf(tiny_paths["llama"], dtype=torch.bfloat16), num_slots=2, max_len=64)
    slots = [runner.alloc_slot() for _ in range(2)]
    batch = RaggedBatch.plan(runner, slots, [[1, 2, 3, 4]] * 2, [1, 1], [4, 4], [0, 0], invariant=True)
    assert batch.index is None and batch.query_positions is batch.positions
