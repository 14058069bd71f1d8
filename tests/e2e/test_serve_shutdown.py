"""`specdec serve` stopping with work under way, as a Kubernetes rollout stops it (SIGTERM).

With requests in flight: health turns NOT_SERVING first (balancers stop sending), a new request
is refused UNAVAILABLE with RetryInfo, a request that can finish within ``router.grace_s``
finishes, one that cannot ends UNAVAILABLE with RetryInfo (a client retries it elsewhere), and
the command exits 0. While it waits for workers that cannot start: SIGTERM ends it at once, not
after the worker timeout. The target worker sleeps per model step (its TEST/BENCHMARK knob
``bench_step_delay_s``), so which request outlives the grace does not depend on the machine's
speed: the long one needs at least 60 s of steps, the short one needs about 1 s of a 20 s grace.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.client import SpecdecClient
from specdec.rpc.client_errors import SpecdecError, Unavailable
from tests.e2e.serve_process import free_port, log_text, serve_process, wait_for_log, wait_serving

STEP_DELAY_S = 0.2
GRACE_S = 20.0
LONG_TOKENS = 300  # >= 60 s of steps: cannot finish within the grace
SHORT_TOKENS = 4


def _worker(path) -> dict:
    return {"model": str(path), "dtype": "float32", "num_slots": 4, "max_len": 512, "threads": 1}


def _watch_health(address: str, seen: list, stop: threading.Event) -> None:
    """Append (time, status name) for each health change the server reports until the stream ends."""
    with grpc.insecure_channel(address) as ch:
        try:
            for resp in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()):
                seen.append((time.monotonic(), health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)))
                if stop.is_set():
                    return
        except grpc.RpcError:
            seen.append((time.monotonic(), "ended"))


def test_sigterm_with_requests_in_flight(tiny_paths, tmp_path):
    port = free_port()
    config = {
        "ray": {"num_cpus": 2},
        "target": {**_worker(tiny_paths["llama"]), "bench_step_delay_s": STEP_DELAY_S},
        "draft": None,
        "router": {"port": port, "metrics_port": None, "http_port": 0, "grace_s": GRACE_S, "default_mode": "off"},
    }
    address = f"127.0.0.1:{port}"
    with serve_process(config, tmp_path, log_format="text") as (proc, log):
        wait_serving(proc, address, log, timeout=240)
        client = SpecdecClient(address)
        health: list = []
        stop_watch = threading.Event()
        watcher = threading.Thread(target=_watch_health, args=(address, health, stop_watch), daemon=True)
        watcher.start()
        results: dict = {}

        def stream(name: str, max_tokens: int, started: threading.Event) -> None:
            chunks = []
            try:
                for c in client.generate_stream("hello world", max_tokens=max_tokens, ignore_eos=True, timeout=300):
                    chunks.append(c)
                    started.set()
                results[name] = (chunks, None, time.monotonic())
            except SpecdecError as exc:
                results[name] = (chunks, exc, time.monotonic())
            finally:
                started.set()

        runners = {}
        for name, n in (("long", LONG_TOKENS), ("short", SHORT_TOKENS)):
            started = threading.Event()
            runners[name] = threading.Thread(target=stream, args=(name, n, started), daemon=True)
            runners[name].start()
            assert started.wait(120), f"the {name} request produced nothing"
        proc.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + 30
        while not any(s == "NOT_SERVING" for _, s in health):
            assert time.monotonic() < t_end, f"health never turned NOT_SERVING: {health}"
            time.sleep(0.05)
        with pytest.raises(Unavailable) as refused:  # no new work once draining
            client.generate("hello", max_tokens=2, timeout=30)
        assert refused.value.retry_delay is not None, refused.value
        for t in runners.values():
            t.join(GRACE_S + 120)
        assert proc.wait(120) == 0, log_text(log)[-4000:]
        stop_watch.set()
        client.close()
        text = log_text(log)

    short_chunks, short_err, _ = results["short"]
    assert short_err is None and short_chunks[-1].finish_reason == "length", results["short"]
    assert sum(len(c.token_ids) for c in short_chunks) == SHORT_TOKENS
    long_chunks, long_err, long_end = results["long"]
    assert isinstance(long_err, Unavailable) and long_err.retry_delay is not None, long_err
    assert "shut down before this request finished" in long_err.message
    assert 0 < sum(len(c.token_ids) for c in long_chunks) < LONG_TOKENS and not long_chunks[-1].finish_reason
    turned = next(t for t, s in health if s == "NOT_SERVING")
    assert turned < long_end, "health turned NOT_SERVING only after the running requests ended"
    assert "received SIGTERM" in text and "specdec stopped" in text and "Traceback" not in text


def test_sigterm_while_waiting_for_workers(tiny_paths, tmp_path):
    """The target asks for a resource no node has: the command waits for it (up to its worker
    timeout, 900 s) until SIGTERM, which ends it cleanly at once."""
    port = free_port()
    config = {
        "ray": {"num_cpus": 2, "resources": {"draft_gpu": 1}},  # no target_gpu anywhere
        "target": _worker(tiny_paths["llama"]),
        "draft": None,
        "router": {"port": port, "metrics_port": None, "http_port": 0},
    }
    with serve_process(config, tmp_path, log_format="text") as (proc, log):
        wait_for_log(proc, log, "waiting for 1 target worker(s) to start", timeout=180)
        time.sleep(1.0)  # well inside the wait
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except Exception:
            pytest.fail(f"specdec serve still waits 60 s after SIGTERM:\n{log_text(log)[-4000:]}")
        text = log_text(log)
    assert rc == 0, text[-4000:]
    assert "received SIGTERM" in text and "specdec stopped" in text and "Traceback" not in text, text[-4000:]
    assert "specdec serving" not in text
