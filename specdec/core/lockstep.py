"""A tensor-parallel group computing in lockstep: rank 0 leads, the other ranks follow.

Rank 0 owns the runner's bookkeeping (slots, lengths, rollback, eviction: the verifier and the
engine call it as any runner). Every forward is first broadcast to the other ranks as a small
command of integers: the rows' slots, their start positions, their tokens and logit counts. The
start positions carry every rollback, free and reuse of a slot that rank 0 made since the last
forward, so a follower that sets its lengths from them and runs the same forward keeps a KV cache
equal to rank 0's shard for shard. Followers do nothing else, in command order.

A failed or timed-out collective (a rank died or hangs: gloo / NCCL timeouts) breaks the group
for good: rank 0 raises :class:`GroupFailure` for that call and every later one, and the group is
restarted as a unit by whoever runs it. While idle, rank 0 sends a heartbeat every quarter of the
timeout, so followers waiting for work do not time out and a dead follower is found.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from specdec.core.runner import ModelRunner, RunnerError

log = logging.getLogger(__name__)

__all__ = ["GroupFailure", "LeaderRunner", "follow"]

OP_FORWARD, OP_NOOP, OP_STOP = 1, 2, 3
OP_FORWARD_FAST = 4  # a forward with the runner's fast (not batch-invariant) numerics
_HEADER = 4  # op, sequence number, rows, payload length


class GroupFailure(RunnerError):
    """A rank of the tensor-parallel group failed or timed out; the group must restart as a unit."""


def _send(op: int, seq: int, rows: int, payload: list[int], group) -> None:
    dist.broadcast(torch.tensor([op, seq, rows, len(payload)], dtype=torch.long), src=0, group=group)
    if payload:
        dist.broadcast(torch.tensor(payload, dtype=torch.long), src=0, group=group)


def _recv(group) -> tuple[int, int, int, list[int]]:
    header = torch.empty(_HEADER, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    op, seq, rows, size = header.tolist()
    payload = torch.empty(size, dtype=torch.long)
    if size:
        dist.broadcast(payload, src=0, group=group)
    return op, seq, rows, payload.tolist()


def _encode(slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]], n_logits) -> list[int]:
    out: list[int] = []
    for slot, start, row, k in zip(slots, starts, tokens, n_logits):
        out += [int(slot), int(start), len(row), int(k)]
    for row in tokens:
        out.extend(int(t) for t in row)
    return out


def _decode(rows: int, payload: list[int]) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    meta = [payload[4 * i : 4 * i + 4] for i in range(rows)]
    at, tokens = 4 * rows, []
    for _, _, n, _ in meta:
        tokens.append(payload[at : at + n])
        at += n
    return [m[0] for m in meta], [m[1] for m in meta], tokens, [m[3] for m in meta]


class LeaderRunner:
    """Rank 0's runner: the same interface as :class:`ModelRunner` (other attributes are the
    sharded runner's own), with each forward announced to the followers first."""

    def __init__(self, runner: ModelRunner, group=None, heartbeat_s: float | None = None):
        self.runner = runner
        self.group = group
        self._lock = threading.Lock()  # one command at a time, in order
        self._seq = 0
        self._last = time.monotonic()
        self._broken: str | None = None
        self._done = threading.Event()  # broken or stopped
        self._heartbeat: threading.Thread | None = None
        if heartbeat_s:
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True, name="tp-heartbeat")
            self._heartbeat.start()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    @property
    def broken(self) -> str | None:
        """Why the group broke, or None while it works."""
        return self._broken

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the group breaks or is stopped; True if it did within `timeout`."""
        return self._done.wait(timeout)

    def _command(self, op: int, rows: int, payload: list[int]) -> None:
        if self._broken is not None:
            raise GroupFailure(f"the tensor-parallel group is down: {self._broken}")
        self._seq += 1
        try:
            _send(op, self._seq, rows, payload, self.group)
        except Exception as exc:  # noqa: BLE001 - any collective failure breaks the group
            self._fail(exc)
        self._last = time.monotonic()

    def _fail(self, exc: BaseException) -> NoReturn:
        self._broken = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        log.error("tensor-parallel group broken: %s", self._broken)
        self._done.set()
        raise GroupFailure(f"the tensor-parallel group is down: {self._broken}") from exc

    @torch.inference_mode()
    def forward(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        num_logits: int | Sequence[int] = 1,
        invariant: bool | None = None,
    ) -> list[torch.Tensor]:
        n_logits = [num_logits] * len(slots) if isinstance(num_logits, int) else list(num_logits)
        invariant = self.runner.invariant_numerics if invariant is None else invariant
        op = OP_FORWARD if invariant else OP_FORWARD_FAST  # every rank takes the same numerics
        with self._lock:
            starts = [self.runner.lengths[s] for s in slots]
            self._command(op, len(slots), _encode(slots, starts, tokens, n_logits))
            try:
                return self.runner.forward(slots, tokens, n_logits, invariant=invariant)
            except GroupFailure:
                raise
            except RunnerError:  # refused before any collective; the followers refuse it too
                raise
            except Exception as exc:  # noqa: BLE001 - a collective failed mid-forward
                self._fail(exc)

    def stop(self) -> None:
        """Release the followers from their loop (they return from :func:`follow`)."""
        with self._lock:
            if self._broken is None and not self._done.is_set():
                try:
                    self._command(OP_STOP, 0, [])
                except GroupFailure:
                    pass
            self._done.set()

    def _beat(self, every: float) -> None:
        while not self._done.wait(every / 2):
            if time.monotonic() - self._last < every or not self._lock.acquire(timeout=every / 2):
                continue
            try:
                if not self._done.is_set():
                    self._command(OP_NOOP, 0, [])
            except GroupFailure:
                return
            finally:
                self._lock.release()


def follow(runner: ModelRunner, group=None) -> None:
    """Ranks > 0: apply rank 0's commands until it stops the group; GroupFailure if the group breaks.

    With a replicated lm_head (no ``gather_logits`` hook) the followers skip it: only rank 0's
    logits are used."""
    expected = 0
    skip_head = runner.gather_logits is None
    while True:
        try:
            op, seq, rows, payload = _recv(group)
        except Exception as exc:  # noqa: BLE001 - rank 0 died, hangs, or the group was torn down
            raise GroupFailure(f"lost rank 0: {type(exc).__name__}: {exc}") from exc
        expected += 1
        if seq != expected:
            raise GroupFailure(f"command {seq} arrived, {expected} expected: the group is out of step")
        if op == OP_STOP:
            return
        if op == OP_NOOP:
            continue
        if op not in (OP_FORWARD, OP_FORWARD_FAST):
            raise GroupFailure(f"unknown command {op}")
        slots, starts, tokens, n_logits = _decode(rows, payload)
        for slot, start in zip(slots, starts):
            runner.lengths[slot] = start
            del runner.slot_tokens[slot][start:]
        try:
            with torch.inference_mode():
                runner.forward(slots, tokens, [0] * rows if skip_head else n_logits, invariant=op == OP_FORWARD)
        except RunnerError as exc:  # rank 0 refused the same call before any collective
            log.info("follower: forward refused like on rank 0: %s", exc)
        except Exception as exc:  # noqa: BLE001
            raise GroupFailure(f"forward failed: {type(exc).__name__}: {exc}") from exc
