"""specdec.bench.soak without a service: the table, the metrics it reads, and no local processes
for an address nothing listens on (the soak itself runs against `specdec serve`: docs/results.md, "Operations")."""

from __future__ import annotations

import socket

from specdec.bench.soak import _local_processes, _sample, format_soak
from tests.static_metrics import static_metrics

METRICS = """# HELP specdec_running_requests Requests being decoded
specdec_running_requests 3.0
specdec_queue_depth 1.0
specdec_process_resident_memory_bytes 1.048576e+08
specdec_process_open_fds 51.0
specdec_worker_free_slots{role="target",worker="target-0"} 2.0
specdec_worker_free_slots{role="draft",worker="draft-0"} 4.0
specdec_worker_rss_bytes{worker="target-0",role="target"} 2.097152e+08
"""


def test_a_sample_from_metrics_and_the_table():
    with static_metrics(METRICS) as url:
        s = _sample(0.0, url, {}, done=7)
    assert s["rss_mb"] == {"router": 100.0, "target-0": 200.0} and s["open_fds"] == 51.0
    assert (s["running"], s["queued"], s["requests_done"]) == (3.0, 1.0, 7)
    assert s["free_slots"] == {"target-0": 2, "draft-0": 4}
    table = format_soak({"samples": [s], "outcomes": {"generate": {"OK": 7}}})
    assert "free:target-0" in table and "rss:router" in table and "generate {'OK': 7}" in table


def test_no_local_processes_where_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _local_processes(f"127.0.0.1:{port}") == {}
