"""Shared fixtures: tiny random models (built once per session) and the SmolLM2-135M pack."""

from __future__ import annotations

import os
import secrets

import pytest
import torch

# Ray's token auth on, with a token made for this test session (docs/design.md, Conventions).
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
# The router <-> worker shared secret, one per session as `specdec serve` makes one per start:
# the workers the tests spawn require it (specdec.rpc.worker_secret).
os.environ.setdefault("SPECDEC_WORKER_SECRET", secrets.token_urlsafe(32))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One torch thread: the models here are small, and with two OpenMP threads any other busy process
# on a 2-core machine (a Ray worker, a parallel job) can make a step ten times slower.
torch.set_num_threads(1)

SMOLLM = "smollm2-135m-instruct"


def skip_for_environment(reason: str) -> None:
    """Skip a test this machine cannot run (no root, no namespaces, a missing tool), saying why.

    With SPECDEC_REQUIRE_ALL=1 (set by .ci/run) the test fails with the same reason instead: CI
    cannot go green without the end-to-end tests having run.
    """
    if os.environ.get("SPECDEC_REQUIRE_ALL") == "1":
        pytest.fail(f"SPECDEC_REQUIRE_ALL=1 and this test cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Tests may change torch's thread count; the next test starts from the session's one thread."""
    yield
    torch.set_num_threads(1)


def chi2_pvalue(samples, probs) -> float:
    """Chi-square goodness of fit of integer samples to `probs` (outcomes of probability zero must not occur)."""
    import numpy as np
    from scipy import stats

    probs = np.asarray(probs, dtype=np.float64)
    obs = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert obs[~support].sum() == 0, "sampled an outcome of probability zero"
    exp = probs[support] / probs[support].sum() * obs.sum()
    return float(stats.chisquare(obs[support], exp).pvalue)


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    """The tiny Llama target, its draft and its tokenizer, loaded (float32)."""
    from transformers import AutoTokenizer

    return {
        "target": load_hf(tiny_paths["llama"]),
        "draft": load_hf(tiny_paths["llama-draft"]),
        "tokenizer": AutoTokenizer.from_pretrained(tiny_paths["llama"]),
    }


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """{'llama': path, 'qwen2': path, 'llama-draft': path} of tiny random models."""
    from specdec.core.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    paths = {arch: make_tiny_model(root / arch, arch=arch, seed=i) for i, arch in enumerate(("llama", "qwen2"))}
    paths["llama-draft"] = make_tiny_draft(paths["llama"], root / "llama-draft")
    return paths


@pytest.fixture(scope="session")
def smollm_path():
    """The converted SmolLM2-135M pack (`make test` prepares it before the suite runs)."""
    from specdec.core import pack_prepare

    return pack_prepare.prepare_pack(SMOLLM, progress=False)


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy_ids(path, prompt_ids: list[int], n: int) -> list[int]:
    """The reference for greedy outputs: ``n`` tokens of transformers' float32 model, a full forward per token."""
    model = load_hf(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (the big model pair, timing comparisons, Ray autoscaling runs) run only with
    SPECDEC_SLOW=1; otherwise they are reported as skipped, with that reason."""
    if os.environ.get("SPECDEC_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="opt-in: SPECDEC_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
