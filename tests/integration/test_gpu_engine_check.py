"""``scripts/gpu_check.py --parts engine`` on a CPU, with toy shapes of the same models: the run a GPU
gets (forwards, the engine at a set acceptance, the service over gRPC without Ray, its workers in
this process and in one of their own) must work whenever one is at hand, and its checks must be
able to fail: a drafter that does not apply the acceptance it is set to, and an engine whose
speculative output differs from k = 0, are reported (and make the script exit with status 1)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The scripts as modules (scripts/ on the path while this module runs), the toy settings and
    one toy model pair."""
    saved = list(sys.path)
    sys.path.insert(0, str(REPO / "scripts"))  # gpu_check.py adds itself what it needs, for good
    try:
        import gpu_check
        import gpu_engine
        import gpu_engine_e2e

        settings = gpu_engine.Settings.of(quick=True, tiny=True)
        pair = gpu_engine.build_pair("cpu", True, settings)
        yield gpu_check, gpu_engine, gpu_engine_e2e, settings, pair
    finally:
        sys.path[:] = saved


def test_engine_part_on_cpu(tmp_path):
    out = tmp_path / "engine.json"
    command = [sys.executable, str(SCRIPT), "--parts", "engine", "--device", "cpu", "--tiny", "--quick"]
    proc = subprocess.run(
        [*command, "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())["engine"]
    assert report["failures"] == []
    assert report["settings"]["tiny"] is True

    forwards = report["forwards"]
    assert forwards["copy bandwidth GB/s"] > 0
    assert len(forwards["models"]) == 2
    for cases in forwards["models"].values():
        assert list(cases) == ["decode b=1", "decode b=8", "decode b=32", "verify 5 b=1", "verify 5 b=8", "prefill 256"]
        for case, row in cases.items():
            assert row["fast"] > 0 and row["invariant"] > 0 and row["roofline, bytes / copy bandwidth"] > 0
            assert ("transformers eager, static cache" in row) != case.startswith("prefill"), row
            # decode and verify again at the static steps' buckets (run eagerly here), logits bitwise equal
            static = not case.startswith("prefill")
            assert (row.get("static logits equal") is True) == static, row
            assert (row.get("fast static", 0) > 0 and row.get("invariant static", 0) > 0) == static, row
    assert all(c == {"graphs": 0, "seconds": 0.0, "bytes": 0} for c in forwards["captured"].values())

    e2e = report["e2e"]
    assert list(e2e["batches"]) == ["b=1", "b=8"]
    for runs in e2e["batches"].values():
        assert list(runs) == ["k=0", "a=0.6", "a=0.8"]
        assert runs["k=0"]["tokens/s"] > 0
        for name in ("a=0.6", "a=0.8"):
            run = runs[name]
            assert run["identical to k=0"] is True and run["failures"] == []
            assert run["accepted"] == run["accepted as planned"] > 0
            assert abs(run["a measured"] - run["a set"]) <= run["tolerance"]
            for key in ("c", "bound tau/(kc+1)", "efficiency", "speedup"):
                assert run[key] > 0, key

    service = report["service"]
    assert "skipped" not in service, service  # this machine has grpcio: the service runs
    # the router and workers in this process, then the workers in a process of their own
    for name in ("k=0", "k=4, a=0.8", "k=0, workers apart", "k=4, a=0.8, workers apart"):
        row = service[name]
        assert row["identical to engine k=0"] is True
        assert row["service rounds"] == row["engine rounds"] == row["service chunks"]
        assert row["fail-open rounds"] == 0
        # the router's phases of those rounds: parts of a round, the Verify's transport within its wall time
        phases = row["router phases ms/round"]
        assert set(phases) == {"round", "draft_wait", "verify", "rpc", "router"}
        assert 0 < phases["rpc"] < phases["verify"] < phases["round"]
        assert phases["draft_wait"] + phases["verify"] + phases["router"] <= phases["round"] * 1.001
        assert (phases["draft_wait"] > 0) == name.startswith("k=4")
    for spec in (service["k=4, a=0.8"], service["k=4, a=0.8, workers apart"]):
        assert spec["engine identical to k=0"] is True and spec["accepted"] == spec["accepted as planned"] > 0

    for title in ("forwards, median ms per call", "engine end to end", "service against engine", "failures: none"):
        assert title in proc.stdout


def test_a_rate_claimed_but_not_applied_fails_the_check(scripts, tmp_path, monkeypatch):
    """A drafter that proposes the target's own continuation everywhere while it says it replaces
    40 % of it: the accepted count departs from the plan, the acceptance from the rate, and the
    script exits with status 1 though every output is still lossless."""
    gpu_check, gpu_engine, e2e, _, pair = scripts
    from fixed_acceptance import FixedAcceptanceDrafter

    class ReplacesNothing(FixedAcceptanceDrafter):
        def planned_token(self, continuation, keep, j):
            return continuation[j]

    monkeypatch.setattr(gpu_engine, "engine_e2e", functools.partial(e2e.engine_e2e, drafter_cls=ReplacesNothing))
    monkeypatch.setattr(gpu_engine, "build_pair", lambda *args: pair)
    out = tmp_path / "engine.json"
    argv = ["--parts", "engine", "--device", "cpu", "--tiny", "--quick", "--out", str(out)]
    monkeypatch.setattr(gpu_engine, "forwards", lambda *args: {"context": 0, "copy bandwidth GB/s": 0, "models": {}})
    assert gpu_check.main(argv) == 1
    report = json.loads(out.read_text())["engine"]
    run = report["e2e"]["batches"]["b=1"]["a=0.6"]
    assert run["identical to k=0"] is True
    assert run["accepted"] > run["accepted as planned"]
    assert any("the drafter's plan says" in f for f in report["failures"])
    assert any("acceptance" in f and "set to 0.6" in f for f in report["failures"])
    assert gpu_check.failures(json.loads(out.read_text()))


def test_an_output_that_differs_from_k0_fails_the_check(scripts, monkeypatch):
    """A target that commits another token than its own at the end of every speculative round."""
    _, _, e2e, settings, pair = scripts
    from specdec.core.target import TargetVerifier

    verify = TargetVerifier.verify

    def off_by_one(self, items, prefill=()):
        results = verify(self, items, prefill)
        for item, result in zip(items, results):
            if item.draft.tokens:
                result.tokens[-1] = (result.tokens[-1] + 1) % pair.vocab_size
        return results

    monkeypatch.setattr(TargetVerifier, "verify", off_by_one)
    out = e2e.engine_e2e(pair, (1,), (0.8,), settings.k, settings.prompt_tokens, settings.max_tokens)
    assert out["batches"]["b=1"]["a=0.8"]["identical to k=0"] is False
    assert any("differ from the same engine's at k = 0" in f for f in out["failures"])
