"""Decode and verify at bucketed static shapes: the forward a CUDA graph captures once and replays.

On a GPU the runner's eager forward is bound by kernel launches, not by the device: a decode or
verify step launches a few hundred small kernels from Python (docs/results.md, "On a GPU": 16-49x
the roofline, where transformers replayed from a CUDA graph is within a few times of it). A CUDA
graph replays them all in one launch, but only at the shapes and addresses it was captured with. So
a decode or verify batch runs here at a *bucket*, (batch, width, span):

* **batch**: 1, 2, 4, ... below ``num_slots``, and ``num_slots``; rows past the batch's own are
  padding rows;
* **width**: tokens per row, 1, 2, 4, ... up to ``max_width`` (a verify is k + 1 tokens); a row
  shorter than the bucket is padded at its end. Wider rows (prefill chunks) and larger batches run
  the runner's eager forward;
* **span**: the keys each row attends over, KEY_BLOCK-aligned powers of two from ``min_span`` up to
  the whole cache (the attention reads a row's cache up to a static span; a small bucket keeps a
  short sequence from reading, and on a GPU copying, the whole context).

Every input is a view of one static buffer (token ids, positions, the KV slot each token's key is
written to, each row's slot), filled by one copy; the bias that hides keys is made from the positions
inside the step. Padding tokens are token 0 at position 0 and write their keys and values to the
runner's *scratch slot* (one KV slot past ``num_slots``, never handed out), so no real slot changes
but at the real tokens' positions. Padding rows attend over the scratch slot; padding queries of a
real row see key 0 only. Their outputs are finite and unused. The step ends with the last hidden
states in a static buffer; the requested positions of the real rows go through the final norm and
the lm_head after it, by the eager forward's own code (`ModelRunner._logits`), as nano-vllm computes
logits after its graph: the lm_head, the largest GEMM of a small model, never runs over padding or
over positions nobody asked logits of (a prompt chunk), and the buffer holds [rows, hidden], not
[rows, vocabulary].

Lossless (docs/design.md, invariant 2): a real row's numbers do not depend on its bucket. The weight
GEMMs run over ``gemm_rows(batch * width)`` rows, which rounds every row as any other such count does
(attention.py's padding rule, or ``runner.gemm_block`` where the rule fails); the attention's query
width is ``attention_width`` of the bucket's, and the keys past a query's position, whatever the span, add
exact zeros (attention.py). tests/unit/test_static_step.py checks the logits bitwise against the eager
forward, and that padding written into a real slot is caught.

The layers are the runner's own (`ModelRunner._layers`); only storing keys and attending differ. The
step has no host synchronisation (no ``.item()``, no shape from data), so on a GPU ``capture`` records
it per bucket, largest first, into one memory pool, as nano-vllm's model runner does. Elsewhere the
step simply runs eagerly: the same code, tested on the CPU (docs/design.md, invariant 6).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.core.attention import (
    attention_width,
    gemm_rows,
    hidden_keys_bias,
    invariant_attention,
    padded_span,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from specdec.core.runner import ModelRunner

log = logging.getLogger(__name__)

MIN_SPAN = 256  # keys: below this, attending over a few more keys costs less than another graph


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    width: int
    span: int


def ladder(top: int) -> list[int]:
    """1, 2, 4, ... below `top`, then `top`."""
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


def span_buckets(max_len: int, min_span: int = MIN_SPAN) -> list[int]:
    """Key spans: KEY_BLOCK-aligned powers of two from `min_span`, then the whole (padded) cache."""
    full = padded_span(max_len)
    out, span = [], padded_span(min(min_span, full))
    while span < full:
        out.append(span)
        span *= 2
    return out + [full]


def _first_at_least(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


class StaticSteps:
    """The runner's static-shape decode/verify steps, and their CUDA graphs once captured."""

    def __init__(self, runner: ModelRunner, max_width: int, min_span: int = MIN_SPAN):
        self.runner = runner
        self.batches = ladder(runner.num_slots)
        self.widths = ladder(max_width)
        self.spans = span_buckets(runner.max_len, min_span)
        self.scratch = runner.num_slots  # the KV slot padding writes to (runner.alloc_kv_cache)
        dev = runner.device
        tokens = self.batches[-1] * self.widths[-1]
        # The GEMM rows of the largest bucket in either numerics (gemm_rows pads in invariant mode).
        self.max_rows = max(tokens, gemm_rows(tokens, runner.dtype))
        # One buffer, one copy in: ids [max_rows], positions [max_rows], write slots [tokens], row slots.
        self._at = (0, self.max_rows, 2 * self.max_rows, 2 * self.max_rows + tokens)
        self.inputs = torch.zeros(self._at[-1] + self.batches[-1], dtype=torch.long, device=dev)
        self.hidden = torch.zeros(self.max_rows, runner.embed.shape[1], dtype=runner.act_dtype, device=dev)
        self.graphs: dict[tuple[Bucket, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None  # the graphs' one memory pool (capture)
        self.captured: dict = {"buckets": [], "seconds": 0.0, "bytes": 0}
        self.runs: Counter[Bucket] = Counter()  # steps run per bucket, for reports and tests
        self.loops: Counter[Bucket] = Counter()  # greedy loops of several steps (static_greedy.py)

    # ---- routing ---------------------------------------------------------------------------------
    def fits(self, lens: Sequence[int]) -> bool:
        """Whether a batch of rows of these lengths has a bucket."""
        return len(lens) <= self.batches[-1] and max(lens) <= self.widths[-1]

    def bucket(self, lens: Sequence[int], starts: Sequence[int]) -> Bucket:
        """The smallest bucket holding rows of these lengths appended at these cache lengths."""
        return self.bucket_of(len(lens), max(lens), max(s + n for s, n in zip(starts, lens)))

    def bucket_of(self, batch: int, width: int, end: int) -> Bucket:
        """The smallest bucket of `batch` rows of `width` tokens whose keys reach position `end` - 1."""
        return Bucket(
            _first_at_least(self.batches, batch),
            _first_at_least(self.widths, width),
            _first_at_least(self.spans, padded_span(end)),
        )

    def rows(self, bucket: Bucket, invariant: bool) -> int:
        """GEMM rows of a step: its tokens, padded by attention.py's rule in invariant mode."""
        tokens = bucket.batch * bucket.width
        return gemm_rows(tokens, self.runner.dtype) if invariant else tokens

    def views(self, bucket: Bucket, invariant: bool) -> tuple[torch.Tensor, ...]:
        """A bucket's static inputs: token ids and positions [rows], write slots [tokens], row slots."""
        rows, tokens, (a, b, c, d) = self.rows(bucket, invariant), bucket.batch * bucket.width, self._at
        inp = self.inputs
        return inp[a : a + rows], inp[b : b + rows], inp[c : c + tokens], inp[d : d + bucket.batch]

    # ---- one step ----------------------------------------------------------------------------------
    def run(
        self,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        lens: list[int],
        starts: list[int],
        n_logits: list[int],
        invariant: bool,
    ) -> list[torch.Tensor]:
        """The runner's forward of checked rows at their bucket: logits [n_logits[b], vocab] per row
        (float32). The caller (ModelRunner.forward) keeps the slots' lengths and tokens."""
        bucket = self.bucket(lens, starts)
        self.runs[bucket] += 1
        self.fill(bucket, slots, tokens, starts)
        graph = self.graphs.get((bucket, invariant))
        if graph is not None:
            graph.replay()
        else:
            self.step(bucket, invariant)
        return self._copy_out(bucket, lens, n_logits, invariant)

    def fill(self, bucket: Bucket, slots: Sequence[int], tokens: Sequence[Sequence[int]], starts: list[int]) -> None:
        """Host side: lay the rows out at [row * width + t], then copy them in at once."""
        w, (a, b, c, d) = bucket.width, self._at
        host = [0] * self.inputs.numel()
        host[c : c + bucket.batch * w] = [self.scratch] * (bucket.batch * w)
        host[d : d + bucket.batch] = [self.scratch] * bucket.batch
        for r, (slot, row, start) in enumerate(zip(slots, tokens, starts)):
            at, n = r * w, len(row)
            host[a + at : a + at + n] = [int(t) for t in row]
            host[b + at : b + at + n] = range(start, start + n)
            host[c + at : c + at + n] = [slot] * n
            host[d + r] = slot
        # A blocking copy: the host list is not kept, and the next step may refill it at once.
        self.inputs.copy_(torch.tensor(host, dtype=torch.long))

    def step(self, bucket: Bucket, invariant: bool) -> None:
        """The forward of a bucket over the static inputs into ``self.hidden``: fixed shapes, no host
        synchronisation, so a CUDA graph can record it."""
        r = self.runner
        ids, positions, write_slot, row_slot = self.views(bucket, invariant)
        rows, (batch, width, span) = ids.shape[0], (bucket.batch, bucket.width, bucket.span)
        tokens = batch * width
        q_width = attention_width(width, r.num_heads, r.num_kv_heads, r.device) if invariant else width
        write_at = positions[:tokens]
        # Query positions [batch, q_width]; columns past the bucket's width are position 0 (see above).
        query_pos = F.pad(write_at.view(batch, width), (0, q_width - width))
        if invariant:
            bias = hidden_keys_bias(query_pos, span)
        else:
            mask = (torch.arange(span, device=r.device) <= query_pos[:, :, None])[:, None]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            r.k_cache[i][write_slot, :, write_at] = k[:tokens]
            r.v_cache[i][write_slot, :, write_at] = v[:tokens]
            qa = F.pad(q[:tokens].view(batch, width, *q.shape[1:]), (0, 0, 0, 0, 0, q_width - width))
            qa = qa.transpose(1, 2)  # [batch, heads, q_width, head_dim]
            if invariant:  # the cache and the rows' slots (cpu_attention.c reads it in place)
                out = invariant_attention(qa, r.k_cache[i], r.v_cache[i], bias, r.head_dim**-0.5, slots=row_slot)
            else:
                keys, vals = r.k_cache[i][row_slot, :, :span], r.v_cache[i][row_slot, :, :span]
                out = F.scaled_dot_product_attention(
                    qa, keys, vals, attn_mask=mask, enable_gqa=qa.shape[1] != keys.shape[1]
                )
            out = out.transpose(1, 2)[:, :width].reshape(tokens, -1)
            return F.pad(out, (0, 0, 0, rows - tokens))

        self.hidden[:rows] = r._layers(r.embedding(ids), positions, invariant, attend)

    def _copy_out(self, bucket: Bucket, lens: list[int], n_logits: list[int], invariant: bool) -> list[torch.Tensor]:
        """Logits of the real rows' requested positions, by the eager forward's code."""
        w = bucket.width
        picked = [b * w + t for b, (n, k) in enumerate(zip(lens, n_logits)) for t in range(n - k, n)]
        return self.runner._logits(self.hidden, picked, n_logits, invariant)

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def all_buckets(self) -> list[Bucket]:
        return [Bucket(b, w, s) for b in self.batches for w in self.widths for s in self.spans]

    @torch.inference_mode()
    def capture(self, invariant: bool | None = None, buckets: Sequence[Bucket] | None = None) -> dict:
        """Capture each bucket's step (default: all) in these numerics (default: the runner's) as a
        CUDA graph, on a GPU; elsewhere nothing. Largest first, all in one memory pool: a smaller
        graph reuses the larger ones' memory, as only one replays at a time. The inputs point every
        write at the scratch slot, so capturing changes no request's cache. Returns and keeps
        {buckets, seconds, bytes}, summed over the calls (a timing script captures both numerics)."""
        r = self.runner
        if r.device.type != "cuda":
            return self.captured
        if r.all_reduce is not None:
            log.info("static steps: tensor-parallel collectives are not captured; running eagerly")
            return self.captured
        invariant = r.invariant_numerics if invariant is None else invariant
        torch.cuda.synchronize(r.device)
        free_before, t0 = torch.cuda.mem_get_info(r.device)[0], time.perf_counter()
        self._reset_inputs()
        order = sorted(buckets or self.all_buckets(), key=lambda b: (b.batch * b.width, b.span), reverse=True)
        for bucket in order:
            self.step(bucket, invariant)  # warm-up: lazy initialisation and the allocator, outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.step(bucket, invariant)
            self._pool = graph.pool() if self._pool is None else self._pool
            self.graphs[(bucket, invariant)] = graph
        torch.cuda.synchronize(r.device)
        used = free_before - torch.cuda.mem_get_info(r.device)[0]
        seconds = time.perf_counter() - t0
        self.captured = {
            "buckets": self.captured["buckets"] + [asdict(b) | {"invariant": invariant} for b in order],
            "seconds": self.captured["seconds"] + seconds,
            "bytes": self.captured["bytes"] + int(used),
        }
        log.info(
            "static steps: captured %d CUDA graphs (%s numerics; batches %s, widths %s, spans %s) in %.1f s, %.0f MiB",
            len(order),
            "invariant" if invariant else "fast",
            sorted({b.batch for b in order}),
            sorted({b.width for b in order}),
            sorted({b.span for b in order}),
            seconds,
            used / 2**20,
        )
        return self.captured

    def _reset_inputs(self) -> None:
        """Token 0 at position 0 for every row, every write into the scratch slot."""
        self.inputs.zero_()
        self.inputs[self._at[2] :].fill_(self.scratch)


__all__ = ["Bucket", "MIN_SPAN", "StaticSteps", "ladder", "span_buckets"]
