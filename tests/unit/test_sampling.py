"""Sampling parameters, logit processing and sampling primitives (specdec/core/sampling.py)."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specdec.core.params import InvalidParams, SamplingParams
from specdec.core.sampling import (
    draw_from_probs,
    gumbel_noise,
    make_generator,
    process_logits,
    sample_sparse,
    sparse_topk,
)
from tests.conftest import chi2_pvalue
from tests.reference_sampling import sample_token

CHI2_ALPHA = 1e-3


# ------------------------------------------------------------------------------------------
# SamplingParams.validate
# ------------------------------------------------------------------------------------------

BAD_FIELDS: dict[str, st.SearchStrategy] = {
    "max_tokens": st.one_of(st.integers(max_value=0), st.just(2.5), st.just(True)),
    "temperature": st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False), st.sampled_from([math.nan, math.inf, -math.inf])
    ),
    "top_p": st.one_of(
        st.floats(max_value=0.0, allow_nan=False),
        st.floats(min_value=1.0, exclude_min=True, allow_nan=False),
        st.just(math.nan),
    ),
    "top_k": st.one_of(st.integers(max_value=-1), st.just(1.5)),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), st.just(1.0)),
    "stop": st.sampled_from([("",), ("ok", ""), (3,)]),
    "stop_token_ids": st.one_of(st.tuples(st.integers(max_value=-1)), st.tuples(st.integers(min_value=100))),
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_each_bad_field_raises_invalid_params_naming_it(field: str, data: st.DataObject) -> None:
    value = data.draw(BAD_FIELDS[field])
    params = SamplingParams(**{"temperature": 0.7, field: value})
    with pytest.raises(InvalidParams) as err:
        params.validate(vocab_size=100)
    assert err.value.field == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


@settings(max_examples=60, deadline=None)
@given(
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0, 100, allow_nan=False),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 1000),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 99), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)
def test_valid_params_pass(**kw) -> None:
    SamplingParams(**kw).validate(vocab_size=100, max_context=8192, prompt_len=4096)


def test_invalid_params_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(InvalidParams("top_p", "must be in (0, 1] (got 2)")))
    assert isinstance(err, InvalidParams) and err.field == "top_p" and str(err).startswith("top_p: ")


def test_context_limits() -> None:
    SamplingParams(max_tokens=10).validate(max_context=100, prompt_len=90)
    with pytest.raises(InvalidParams) as err:
        SamplingParams(max_tokens=11).validate(max_context=100, prompt_len=90)
    assert err.value.field == "max_tokens" and "[1, 10]" in str(err.value)
    with pytest.raises(InvalidParams) as err:
        SamplingParams(max_tokens=1).validate(max_context=100, prompt_len=100)
    assert err.value.field == "prompt"


def test_params_coercion_and_greedy() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert p.stop == ("a", "b") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]
    hash(p)  # frozen and hashable
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


# ------------------------------------------------------------------------------------------
# process_logits
# ------------------------------------------------------------------------------------------


def reference_process(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straightforward sort-based reference (float64): temperature, top_k, top_p, renormalise."""
    x = row.double()
    if p.greedy:
        return torch.log_softmax(x, -1)
    x = x / p.temperature
    if p.top_k:
        kth = torch.sort(x, descending=True).values[min(p.top_k, len(x)) - 1]
        x = torch.where(x >= kth, x, -torch.inf)
    if p.top_p < 1:
        probs = torch.softmax(x, -1)
        s = torch.sort(probs, descending=True).values
        before = s.cumsum(0) - s  # mass strictly before each sorted token
        cut = s[before < p.top_p].min()
        x = torch.where(probs >= cut, x, -torch.inf)
    return torch.log_softmax(x, -1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
    ],
)
def test_process_logits_matches_reference(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=g) * 2
    before = logits.clone()
    out = process_logits(logits, params)
    assert torch.equal(logits, before), "process_logits modified its input"
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i in range(8):
        ref = reference_process(logits[i], params)
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(ref))
        fin = torch.isfinite(ref)
        assert torch.allclose(out[i][fin].double(), ref[fin], atol=1e-5)
    if params.top_k:
        assert bool((torch.isfinite(out).sum(-1) == params.top_k).all()) or params.top_p < 1


def test_top_p_keeps_ties_and_crossing_token() -> None:
    probs = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1])
    out = process_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.5))
    # 0.4 < 0.5, so the crossing token (prob 0.2) is kept, and its tie too.
    assert torch.isfinite(out).tolist() == [True, True, True, False, False]
    out = process_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.4))
    assert torch.isfinite(out).tolist() == [True, False, False, False, False]


def test_process_logits_rows_identical_alone_or_batched() -> None:
    """Invariant-mode sampling needs a row's processed log-probs bit-identical in any batch, even
    when rows of the batch need different top_p search sizes (256 / 4096 / full sort)."""
    v = 6000
    g = torch.Generator().manual_seed(1)
    rows = torch.stack(
        [
            torch.randn(v, generator=g) * 8,  # peaked: nucleus well inside the top 256
            torch.randn(v, generator=g) * 2.2,  # nucleus between 256 and 4096
            torch.randn(v, generator=g) * 0.1,  # nearly flat: needs the full sort
        ]
    )
    for params in [
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.1, top_k=300, top_p=0.95),
        SamplingParams(temperature=0.3),
    ]:
        batched = process_logits(rows, params)
        sizes = torch.isfinite(batched).sum(-1).tolist()
        for i in range(3):
            assert torch.equal(process_logits(rows[i], params), batched[i]), (params, i)
            assert torch.equal(process_logits(rows[i : i + 1], params)[0], batched[i])
        if params.top_p == 0.9 and params.top_k == 0:
            assert sizes[0] < 256 < sizes[1] < 4096 < sizes[2], sizes


def test_process_logits_batch_invariant_at_real_vocab_with_threads() -> None:
    """Same property at V = 151,936 with intra-op threads on (kernels split work differently for
    one row and for a batch once tensors pass torch's parallel grain size)."""
    torch.set_num_threads(2)  # the autouse fixture restores the previous setting
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(4, 151_936, generator=g) * torch.tensor([[6.0], [3.0], [1.0], [0.5]])
    for params in [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.2, top_p=0.95),
    ]:
        batched = process_logits(rows, params)
        for i in range(4):
            assert torch.equal(process_logits(rows[i], params), batched[i]), (params, i)


def test_tiny_temperature_is_finite() -> None:
    logits = torch.tensor([[100.0, 99.0, -50.0]])
    out = process_logits(logits, SamplingParams(temperature=1e-30))
    assert not torch.isnan(out).any()
    assert int(out.argmax()) == 0 and out[0, 0] == 0


# ------------------------------------------------------------------------------------------
# gumbel_noise
# ------------------------------------------------------------------------------------------


def test_gumbel_noise_is_a_pinned_pure_function() -> None:
    a = gumbel_noise(1234, 7, 5)
    assert a.dtype == torch.float32 and a.shape == (5,)
    assert torch.equal(a, gumbel_noise(1234, 7, 5))
    # Pinned values: changing the stream would change every seeded output ever produced.
    expected = [2.2768073081970215, -1.002442479133606, 4.175276279449463, 1.5573030710220337, -0.6976118683815002]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)
    assert gumbel_noise(0, 0, 3).tolist() == pytest.approx(
        [-1.49545156955719, -0.3511371314525604, -0.7859067916870117], abs=1e-6
    )
    assert not torch.equal(a, gumbel_noise(1234, 8, 5))
    assert not torch.equal(a, gumbel_noise(1235, 7, 5))
    # A smaller vocabulary sees a prefix of the same noise (drafter and target may pad differently).
    assert torch.equal(gumbel_noise(9, 3, 1000)[:700], gumbel_noise(9, 3, 700))


def test_gumbel_noise_distribution() -> None:
    g = gumbel_noise(2**64 - 1, 10**6, 151_936)
    assert torch.isfinite(g).all()
    assert stats.kstest(g.double().numpy(), "gumbel_r").pvalue > CHI2_ALPHA


@pytest.mark.slow  # a timing bound: opt-in (pyproject.toml, markers)
def test_gumbel_noise_speed() -> None:
    v = 151_936
    gumbel_noise(2**64 - 1, 10**6, v)
    t0 = time.perf_counter()
    gumbel_noise(2**64 - 1, 10**6, v)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.25, f"gumbel_noise took {elapsed * 1e3:.1f} ms for V={v}"


# ------------------------------------------------------------------------------------------
# sample_token / sparse_topk / draw_from_probs
# ------------------------------------------------------------------------------------------

P6 = np.array([0.05, 0.3, 0.02, 0.33, 0.2, 0.1])


def test_greedy_sample_is_argmax() -> None:
    row = torch.tensor([0.1, 3.0, 2.0])
    assert sample_token(row, SamplingParams(), generator=None, position=0) == 1


def _invariant_samples(noise_fn, n: int) -> np.ndarray:
    logp = torch.tensor(np.log(P6), dtype=torch.float32)
    return np.array([int(torch.argmax(logp + noise_fn(s))) for s in range(n)])


def test_invariant_sampling_is_distributed_as_p_and_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logp = torch.tensor(np.log(P6), dtype=torch.float32)
    first = sample_token(logp, params, generator=None, position=11)
    assert all(sample_token(logp, params, generator=None, position=11) == first for _ in range(3))
    n = 20_000
    samples = np.array(
        [sample_token(logp, SamplingParams(temperature=1.0, seed=s), generator=None, position=3) for s in range(n)]
    )
    assert chi2_pvalue(samples, P6) > CHI2_ALPHA
    # The same check catches a broken noise (uniform instead of Gumbel: argmax is biased).
    broken = _invariant_samples(
        lambda s: torch.from_numpy(np.random.Philox(key=[s, 3]).random_raw(6) / 2.0**64).float(), n
    )
    assert chi2_pvalue(broken, P6) < CHI2_ALPHA


def test_generator_sampling_is_distributed_as_p_and_reproducible() -> None:
    params = SamplingParams(temperature=1.0)
    logp = torch.tensor(np.log(P6), dtype=torch.float32)
    g = make_generator(42)
    samples = [sample_token(logp, params, generator=g) for _ in range(20_000)]
    assert chi2_pvalue(samples, P6) > CHI2_ALPHA
    g1, g2 = make_generator(7), make_generator(7)
    assert [sample_token(logp, params, generator=g1) for _ in range(50)] == [
        sample_token(logp, params, generator=g2) for _ in range(50)
    ]


def test_draw_from_probs_never_returns_zero_weight() -> None:
    w = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    for u in [0.0, 0.25, 0.5, 0.9999999999999999, 1.0 - 2**-53]:
        assert draw_from_probs(w, u) in (1, 3)
    assert draw_from_probs(w, 0.0) == 1 and draw_from_probs(w, 0.75) == 3


def test_sparse_topk_and_sample_sparse() -> None:
    logits = torch.tensor([1.0, 3.0, -torch.inf, 2.0, 0.5, -torch.inf])
    logp = torch.log_softmax(logits, -1)
    ids, probs = sparse_topk(logp, 3)
    assert ids == [1, 3, 0]
    assert all(np.float32(p) == p for p in probs), "probs must survive a float32 round trip"
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-6)
    expected = torch.softmax(logits[[1, 3, 0]].double(), 0).tolist()
    assert probs == pytest.approx(expected, rel=1e-6)
    ids_all, _ = sparse_topk(logp, 10)  # masked tokens are dropped
    assert sorted(ids_all) == [0, 1, 3, 4]
    g = make_generator(3)
    samples = [sample_sparse(ids, probs, g) for _ in range(20_000)]
    full = np.zeros(6)
    full[ids] = probs
    assert chi2_pvalue(samples, full) > CHI2_ALPHA


def test_core_modules_import_without_torch() -> None:
    """The router (no torch) uses SamplingParams, StopChecker, choose_mode, n-gram drafting."""
    code = (
        "import sys\n"
        "from specdec.core.params import SamplingParams, InvalidParams, VerifyMode, choose_mode\n"
        "from specdec.core.round_types import Draft\n"
        "from specdec.core.stops import StopChecker\n"
        "from specdec.core.ngram import NgramDrafter\n"
        "from specdec.core.speedup import best_k\n"
        "from specdec.core.adaptive_k import AdaptiveK\n"
        "p = SamplingParams(temperature=0.5, seed=1, stop=('x',)); p.validate(vocab_size=10)\n"
        "assert choose_mode(p) is VerifyMode.INVARIANT\n"
        "c = StopChecker(p, {0}, lambda t: ''.join(map(str, t)))\n"
        "c.accept([1, 2]); NgramDrafter().propose([[1, 2, 1]], [2]); AdaptiveK().next_k()\n"
        "bad = [m for m in ('torch', 'ray', 'grpc', 'pynvml') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_make_generator_unseeded_differs() -> None:
    a = torch.rand(4, generator=make_generator(None))
    b = torch.rand(4, generator=make_generator(None))
    assert not torch.equal(a, b)


def test_make_generator_takes_the_full_64_bit_seed() -> None:
    # Seeds are 64-bit on the wire; the largest must seed the generator as itself, deterministically.
    top = 2**64 - 1
    assert make_generator(top).initial_seed() == top
    draws = torch.rand(4, generator=make_generator(top))
    assert torch.equal(draws, torch.rand(4, generator=make_generator(top)))
    assert not torch.equal(draws, torch.rand(4, generator=make_generator(top - 1)))
