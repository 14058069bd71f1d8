"""One thread for all of a worker process's model work.

The OpenMP runtime of torch's CPU builds (GNU libgomp) gives every thread that starts parallel work
a team of its own. Once the process holds more OpenMP threads than it has cores, libgomp stops
letting idle threads spin between parallel regions and puts them to sleep after each one, so every
op of a forward (hundreds of them) pays a wake-up. A gRPC server calling the model from the threads
of its pool builds such teams one per thread: on the 2-core machine SmolLM2-135M's decode took
78 ms a token instead of 54 once a second thread had run a forward, in that thread and in the first
alike (docs/results.md, "Small costs behind rules in the code"). So a worker loads its model and
runs every forward, prefill and release on this one thread (`on_torch_thread`), and torch keeps one
team. Calls from any thread queue on it, one at a time: the worker's "one forward at a time".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["on_torch_thread", "torch_thread_ident"]

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_ident: int | None = None
_lock = threading.Lock()


def _start() -> None:
    global _ident
    _ident = threading.get_ident()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch", initializer=_start)
        return _pool


def on_torch_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the process's torch thread (directly when already on it); its
    exception, if any, raised here."""
    if threading.get_ident() == _ident:
        return fn(*args, **kwargs)
    return _executor().submit(fn, *args, **kwargs).result()


def torch_thread_ident() -> int | None:
    """The torch thread's id once it has run something (tests check that forwards ran there)."""
    return _ident
