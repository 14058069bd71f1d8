"""Token trees on the worker protocol: carried whole, refused when malformed, and the router's check
that a verdict is a path of the tree it sent (docs/design.md, "Token trees")."""

from __future__ import annotations

import math

import pytest

from specdec.core.params import InvalidParams
from specdec.core.round_types import Draft
from specdec.rpc import worker_pb2
from specdec.rpc.convert import draft_from_proto, draft_to_proto

TREE = Draft(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 0], scores=[math.log(0.6), math.log(0.3), -0.7, -2.0])


def test_a_tree_travels_whole():
    back = draft_from_proto(draft_to_proto("r", TREE), vocab_size=10)
    assert back.tokens == TREE.tokens and back.parents == TREE.parents
    assert back.scores == pytest.approx(TREE.scores)
    chain = draft_from_proto(draft_to_proto("r", Draft(tokens=[1, 2])), vocab_size=10)
    assert chain.parents is None and chain.scores is None
    # A sampled tree keeps each node's q (specdec/core/tree_sampling.py).
    qs = [([5, 6], [0.5, 0.5])] * 2 + [([7, 8], [0.75, 0.25])] * 2
    sampled = Draft(tokens=list(TREE.tokens), probs=qs, parents=list(TREE.parents), scores=list(TREE.scores))
    back = draft_from_proto(draft_to_proto("r", sampled), vocab_size=10)
    assert back.parents == TREE.parents and back.probs == qs


@pytest.mark.parametrize(
    "fields,bad",
    [
        (dict(parents=[-1, 2, 0, 0]), "parents"),  # a parent after its child
        (dict(parents=[-1, 0]), "parents"),  # not one per token
        (dict(scores=[0.1, -1.0, -1.0, -1.0]), "scores"),  # a probability above 1
        (dict(scores=[-1.0]), "scores"),
        (dict(dists=[worker_pb2.SparseDist(ids=[5], probs=[1.0])] * 2), "dists"),  # not one per token
    ],
)
def test_a_malformed_tree_is_refused(fields, bad):
    m = draft_to_proto("r", TREE)
    for name, value in fields.items():
        m.ClearField(name)
        getattr(m, name).extend(value)
    with pytest.raises(InvalidParams) as err:
        draft_from_proto(m, vocab_size=10)
    assert err.value.field.endswith(bad)


def test_a_verdict_must_be_a_path_of_the_tree():
    assert TREE.holds([]) and TREE.holds([5]) and TREE.holds([6]) and TREE.holds([5, 8])
    assert not TREE.holds([6, 7])  # 7 is a child of 5, not of 6
    assert not TREE.holds([7])
    assert Draft(tokens=[1, 2, 3]).holds([1, 2]) and not Draft(tokens=[1, 2, 3]).holds([2])
    assert TREE.depth == 2 and Draft(tokens=[1, 2, 3]).depth == 3
