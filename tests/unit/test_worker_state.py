"""Per-request worker state lives and dies with the KV slot: no map keyed by request id outgrows the slots.

20,000 request ids go through a 2-slot target verifier and a 2-slot model drafter (real runners on
a one-layer tiny model), ending every way a request can: released, evicted (least recently used,
for an id never released: a crashed router, a direct caller) and released again after its slot
was gone (a late cancel). After every call, every dict the verifier and the drafter hold has at
most 2 entries. Error messages about slots give counts, never request ids.
"""

from __future__ import annotations

import pytest

from specdec.core.drafters import DraftInput, ModelDrafter
from specdec.core.ngram import NgramDrafter
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.core.runner import ModelRunner, SlotsExhausted
from specdec.core.target import TargetVerifier, VerifyItem
from tests.conftest import load_hf

SLOTS = 2
IDS = 20_000
GREEDY = SamplingParams(max_tokens=8)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.7, seed=5)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """One layer, hidden 16: 20,000 forwards take seconds (the state under test does not care)."""
    from specdec.core.tiny import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("one-layer"), num_hidden_layers=1, hidden_size=16, intermediate_size=32
    )
    return load_hf(path)


def _request_maps(obj) -> dict[str, int]:
    """Sizes of every dict an object holds directly (the per-request maps, and any added later)."""
    return {name: len(v) for name, v in vars(obj).items() if isinstance(v, dict)}


def _assert_bounded(owner) -> None:
    """The verifier's or drafter's own maps, and its slot table's."""
    for obj in (owner, owner.slots):
        sizes = _request_maps(obj)
        assert sizes, f"{type(obj).__name__} holds no dict: the check would be empty"
        assert all(n <= SLOTS for n in sizes.values()), f"{type(obj).__name__}: {sizes}"


def _end(i: int, release) -> None:
    """How request i ends: released (i % 3 == 0), never released (evicted later, 1), or released
    while live and once more when gone (a cancel, then a late duplicate, 2)."""
    if i % 3 != 1:
        release(f"r{i}")
    if i % 3 == 2:
        release(f"r{i}")


def test_20000_ids_through_a_2_slot_target_keep_no_more_state_than_slots(small_model):
    verifier = TargetVerifier(ModelRunner(small_model, num_slots=SLOTS, max_len=16))
    for i in range(IDS):
        params = SAMPLED if i % 2 else GREEDY
        if i % 50 == 0:  # now and then a real verify (the common path), else a cheap one-token prefill
            mode = VerifyMode.REJECTION if i % 2 else VerifyMode.GREEDY
            verifier.verify([VerifyItem(f"r{i}", [1, 2, 3], params, mode, Draft(tokens=[4]))])
        else:
            verifier.prefill([(f"r{i}", [7], params)])
        _end(i, verifier.release)
        _assert_bounded(verifier)
    assert verifier.generators  # it did keep state for the live ones
    for rid in list(verifier.generators):
        verifier.release(rid)
    assert _request_maps(verifier) == {"generators": 0} and set(_request_maps(verifier.slots).values()) == {0}


def test_20000_ids_through_a_2_slot_drafter_keep_no_more_state_than_slots(small_model):
    drafter = ModelDrafter(ModelRunner(small_model, num_slots=SLOTS, max_len=16), lookup=NgramDrafter(3, 1))
    budgets_seen = 0
    for i in range(0, IDS, 2):
        # Two new ids per call: both slots change hands every call. Now and then a greedy row with
        # a repeating text and k = 2 gets prompt-lookup guesses (the guess budget; it may take a
        # second forward); the other rows draft one token, sampled rows with their generator.
        k = 2 if i % 20 == 0 else 1
        drafter.propose(
            [
                DraftInput(f"r{i}", [1, 2, 1], GREEDY, VerifyMode.GREEDY, k),
                DraftInput(f"r{i + 1}", [3, 4], SAMPLED, VerifyMode.REJECTION, 1),
            ]
        )
        budgets_seen += bool(drafter.guess_budget)
        _end(i, drafter.release)
        _end(i + 1, drafter.release)
        _assert_bounded(drafter)
    assert budgets_seen > 0 and drafter.generators  # both maps were in use
    for rid in list(drafter.generators):
        drafter.release(rid)
    assert set(_request_maps(drafter).values()) == {0}


def test_slot_errors_give_counts_not_request_ids(small_model):
    verifier = TargetVerifier(ModelRunner(small_model, num_slots=SLOTS, max_len=16))
    ids = ["secret-a", "secret-b", "secret-c"]
    with pytest.raises(SlotsExhausted) as err:
        verifier.prefill([(rid, [7], GREEDY) for rid in ids])
    message = str(err.value)
    assert "3 new" in message and str(SLOTS) in message
    assert not any(rid in message for rid in ids), message
    # a batch holding every slot leaves none to evict for a newcomer
    verifier.prefill([(rid, [7], GREEDY) for rid in ids[:2]])
    with pytest.raises(SlotsExhausted) as err:
        verifier.slots.get("newcomer", busy=set(ids[:2]))
    assert not any(rid in str(err.value) for rid in [*ids, "newcomer"]), str(err.value)
    assert len(verifier.generators) == 2  # the refused batch left nothing behind
