"""A machine's profile: what the cost model and the acceptance model need, as measured by
``specdec profile`` (:mod:`cluster.planning.profiler`), saved as JSON. Torch-free: the simulator
and the planner read profiles without loading a model.

Times are milliseconds of worker compute. Forward grids are by (batch, tokens per row) at a fixed
context; prefill curves by prompt tokens; the draft model's whole Propose by (batch, k) on the
workload's prompts (its lookup guesses make a round cheaper where the text is a copy). Acceptance
is kept per request as rounds ``[k asked, tokens drafted, tokens accepted, count]`` so the
simulator can replay each prompt's own acceptance (copy-heavy prompts accept more than new code).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "ProfileError", "Grid", "Curve", "RequestRounds", "DrafterStats", "Overhead", "Profile"]

SCHEMA = "specdec-profile/1"


class ProfileError(ValueError):
    """A profile that cannot be used; the message says what to fix."""


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends (never below 0)."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] else 1.0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > xs[-1]:
        y = max(y, ys[-1])  # a bigger forward never costs less than the largest measured one
    return max(y, 0.0)


@dataclass
class Grid:
    """Forward time (ms) by batch rows and tokens per row, at ``context`` cached tokens per row."""

    batch: list[int]
    tokens: list[int]
    ms: list[list[float]]  # ms[i][j]: batch[i] rows of tokens[j] tokens
    context: int = 0
    # The runner's invariant forward runs its weight GEMMs over blocks of exactly this many rows
    # (ModelRunner.gemm_block), so its time steps up by a block's GEMMs at each multiple: priced by
    # blocks (`_at_rows`), not by a line between cells that ran different block counts.
    row_block: int | None = None

    def __post_init__(self) -> None:
        if not self.batch or not self.tokens or len(self.ms) != len(self.batch):
            raise ProfileError("a forward grid needs batch sizes, token counts and one row of times per batch size")
        if any(len(row) != len(self.tokens) for row in self.ms):
            raise ProfileError("a forward grid needs one time per token count in every row")
        if sorted(set(self.batch)) != self.batch or sorted(set(self.tokens)) != self.tokens:
            raise ProfileError("forward grid sizes must be increasing")

    def at(self, batch: float, tokens: float) -> float:
        if self.row_block:
            by_batch = [self._at_rows(b, row, batch * tokens) for b, row in zip(self.batch, self.ms)]
        else:
            by_batch = [interp(self.tokens, row, tokens) for row in self.ms]
        return interp(self.batch, by_batch, batch)

    def _at_rows(self, b: int, row: list[float], rows: float) -> float:
        """Grid row ``b``'s time for a forward of ``rows`` rows in all: between its cells of the same
        block count, a line by rows (attention, the logits); across block counts, a line by blocks
        through each count's mean."""
        size = self.row_block
        assert size
        blocks = max(1, math.ceil(rows / size - 1e-9))
        cells = [(b * n, ms) for n, ms in zip(self.tokens, row)]
        same = [(r, ms) for r, ms in cells if math.ceil(r / size) == blocks]
        if len(same) > 1:
            return interp([r for r, _ in same], [ms for _, ms in same], rows)
        if same:
            return same[0][1]
        by_count: dict[int, list[float]] = {}
        for r, ms in cells:
            by_count.setdefault(math.ceil(r / size), []).append(ms)
        counts = sorted(by_count)
        return interp(counts, [sum(by_count[c]) / len(by_count[c]) for c in counts], blocks)


@dataclass
class Curve:
    """Time (ms) by tokens (a prefill of n prompt tokens)."""

    tokens: list[int]
    ms: list[float]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms) or sorted(set(self.tokens)) != self.tokens:
            raise ProfileError("a prefill curve needs increasing token counts, one time each")

    def at(self, tokens: float) -> float:
        return interp(self.tokens, self.ms, tokens) if tokens > 0 else 0.0


@dataclass
class RequestRounds:
    """One prompt as the profile's run saw it."""

    id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop": ended by itself; "length": would have gone on past max_tokens
    rounds: list[list[int]] = field(default_factory=list)  # [k, drafted, accepted, count]
    # [k, drafted, accepted] of its first round (one of ``rounds``), [] where not recorded: a first
    # draft often fails at its first token (an n-gram from the prompt's tail), which the adaptive k
    # starts from, so the simulator draws it apart from the later rounds
    first: list[int] = field(default_factory=list)
    # per output position, how many output tokens from there the greedy draft model drafts in a row
    # (cluster/planning/greedy_path.py); [] for the n-gram drafter and older profiles
    agree: list[int] = field(default_factory=list)


def merge_rounds(row_lists: list[list[list[int]]]) -> list[list[int]]:
    """[k, drafted, accepted, count] rows of several requests merged into one such list."""
    counts: dict[tuple[int, int, int], int] = {}
    for rows in row_lists:
        for k, d, a, n in rows:
            counts[(k, d, a)] = counts.get((k, d, a), 0) + n
    return [[k, d, a, n] for (k, d, a), n in sorted(counts.items())]


@dataclass
class DrafterStats:
    """Acceptance of one drafter on the profile's workload, and (model drafts) what a round's drafting cost."""

    name: str  # "draft" (the draft model, as the draft worker runs it) or "ngram"
    requests: list[RequestRounds]
    draft_ms_fixed: float = 0.0  # a round's drafting at batch 1: fixed + per_token x k
    draft_ms_per_token: float = 0.0

    def pooled(self) -> list[list[int]]:
        """Every request's rounds, merged into [k, drafted, accepted, count] rows."""
        return merge_rounds([r.rounds for r in self.requests])

    def summary(self) -> dict[str, float]:
        rows = self.pooled()
        rounds = sum(r[3] for r in rows)
        drafted = sum(r[1] * r[3] for r in rows)
        accepted = sum(r[2] * r[3] for r in rows)
        rejections = sum(r[3] for r in rows if r[2] < r[1])
        return {
            "rounds": rounds,
            "k_mean": round(sum(r[0] * r[3] for r in rows) / rounds, 3) if rounds else 0.0,
            "drafted_per_round": round(drafted / rounds, 3) if rounds else 0.0,
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "acceptance_mle": round(accepted / (accepted + rejections), 4) if accepted + rejections else 0.0,
            "tau": round((accepted + rounds) / rounds, 3) if rounds else 1.0,
        }


@dataclass
class Overhead:
    """Per round, outside the workers' compute: the router, and the RPCs' own time. ``verify_scale``:
    the target worker's Verify compute in the service over the profile's forward at the same batch
    and tokens per row (the forward grid, timed alone in the profiling process, misses what the
    service's other processes cost it); ``verify_scale_by_batch``: the same as
    [mean batch, scale] points from speculative rounds (the grid's cells are timed at different
    moments, so its batch shape is off too), interpolated, used when there are any;
    ``verify_scale_plain_by_batch``: the same from plain-decoding rounds (one token per row, whose
    scale differed from the speculative rounds' by 20-30 % at batch 1). ``prefill_scale``: the
    service's prefill time over the profile's prefill curve for the same prompts. ``draft_scale``:
    the draft worker's Propose compute in the service over the profile's Propose at the same rows
    and steps; ``draft_scale_by_batch``: the same as [mean rows, scale] points, used when there are
    any (on the float32 Qwen pair it went from 1.9 at one row to 1.0 at six).
    ``draft_step_by_rows``: the service's own Propose per draft step as [mean rows, ms per step]
    points, one per calibration scenario that timed Proposes, interpolated; when set they price the
    draft's Propose in place of the profile's grid (timed on the draft's own continuations, whose
    prompt-lookup guesses hit otherwise than on the target's text: its shape in rows and steps was
    off by 15-25 % at 1.5-2.6 rows on the float32 Qwen pair). Past the last point
    the grid's growth in rows carries it on (a line through 1-2.7 rows priced a step of 8 rows
    1.4-1.6x what the service took). Points, not a line: the cost per
    step is concave in the rows, and a line through 1-6.9 rows priced the one-row step, where the
    light rates draft, 15 % over the service's).
    ``draft_prefill_scale``: the draft's prefill work over the profile's curve, set so that the
    simulated drafter's Prefills take as long per token as the service's did (its contention with
    the target included, which the simulated shared device adds itself:
    ``cluster.planning.sim_calibration.calibrate_draft_prefill``)."""

    router_ms: float = 1.0
    router_ms_per_row: float = 0.0
    verify_rpc_ms: float = 1.0
    draft_rpc_ms: float = 1.0
    verify_scale: float = 1.0
    verify_scale_by_batch: list[list[float]] = field(default_factory=list)
    verify_scale_plain_by_batch: list[list[float]] = field(default_factory=list)
    prefill_scale: float = 1.0
    draft_scale: float = 1.0
    draft_scale_by_batch: list[list[float]] = field(default_factory=list)
    draft_step_by_rows: list[list[float]] = field(default_factory=list)
    draft_prefill_scale: float = 1.0
    source: str = "default (not measured)"

    def verify_scale_at(self, batch: float, tokens_per_row: int = 2) -> float:
        """The scale for a verify of ``batch`` rows of ``tokens_per_row`` tokens: the points of its
        kind (plain or speculative), else the other kind's, else ``verify_scale``."""
        plain, spec = self.verify_scale_plain_by_batch, self.verify_scale_by_batch
        return _scale_at((plain or spec) if tokens_per_row <= 1 else (spec or plain), batch, self.verify_scale)

    def draft_scale_at(self, batch: float) -> float:
        """The scale for a Propose of ``batch`` rows: its points, else ``draft_scale``."""
        return _scale_at(self.draft_scale_by_batch, batch, self.draft_scale)

    def propose_ms(self, grid: Grid | None, batch: float, k: float) -> float | None:
        """The service's Propose of ``batch`` rows and ``k`` steps (ms): its per-step points, else the
        profile's Propose ``grid`` times the scale at that batch; None with neither."""
        if self.draft_step_by_rows:
            step = _scale_at(self.draft_step_by_rows, batch, 0.0)  # flat past the last point
            edge = max(r for r, _ in self.draft_step_by_rows)
            if grid is not None and batch > edge:
                return k * step * grid.at(batch, k) / grid.at(edge, k)
            return k * step
        return grid.at(batch, k) * self.draft_scale_at(batch) if grid is not None else None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Overhead:
        """An ``Overhead`` as saved; profiles calibrated before the per-step points kept a line
        (``draft_step_ms``: [fixed, per row], bounded by ``draft_step_rows``, 0 for none), read as
        the line's points at one row and at its bound (two rows without one)."""
        d = dict(d)
        line, edge = d.pop("draft_step_ms", None), d.pop("draft_step_rows", 0.0)
        if line and "draft_step_by_rows" not in d:
            fixed, per_row = line
            edge = edge or 2.0
            d["draft_step_by_rows"] = [[1.0, fixed + per_row], [edge, fixed + per_row * edge]]
        return Overhead(**d)


def _scale_at(points: list[list[float]], batch: float, default: float) -> float:
    """[batch, scale] points interpolated at ``batch`` (flat past both ends); ``default`` without any."""
    pts = sorted(points)
    if not pts:
        return default
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if batch <= b1:
            return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    return pts[-1][1]


@dataclass
class Profile:
    machine: dict[str, Any]
    device: str
    target: dict[str, Any]  # model, dtype, config (layers, hidden, heads, kv_heads, head_dim, vocab, params)
    target_forward: Grid
    target_prefill: Curve
    draft: dict[str, Any] | None = None
    draft_forward: Grid | None = None
    draft_prefill: Curve | None = None
    draft_propose: Grid | None = None  # a whole Propose by (batch, k), lookup guesses included
    overhead: Overhead = field(default_factory=Overhead)
    drafters: dict[str, DrafterStats] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)  # prompts, max_tokens, k_policy of the acceptance run
    tp: dict[str, Any] | None = None  # target verify by TP degree: not measured yet (tensor parallelism is new)
    created: str = ""
    budget_s: float | None = None
    elapsed_s: float = 0.0
    skipped: list[str] = field(default_factory=list)  # parts the time budget left out
    schema: str = SCHEMA

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ProfileError(f"not a specdec profile (expected schema {SCHEMA!r}); make one with `specdec profile`")
        try:
            drafters = {
                name: DrafterStats(
                    name=s["name"],
                    requests=[RequestRounds(**r) for r in s["requests"]],
                    draft_ms_fixed=s.get("draft_ms_fixed", 0.0),
                    draft_ms_per_token=s.get("draft_ms_per_token", 0.0),
                )
                for name, s in d.get("drafters", {}).items()
            }
            return cls(
                machine=d["machine"],
                device=d["device"],
                target=d["target"],
                target_forward=Grid(**d["target_forward"]),
                target_prefill=Curve(**d["target_prefill"]),
                draft=d.get("draft"),
                draft_forward=Grid(**d["draft_forward"]) if d.get("draft_forward") else None,
                draft_prefill=Curve(**d["draft_prefill"]) if d.get("draft_prefill") else None,
                draft_propose=Grid(**d["draft_propose"]) if d.get("draft_propose") else None,
                overhead=Overhead.from_dict(d.get("overhead", {})),
                drafters=drafters,
                workload=d.get("workload", {}),
                tp=d.get("tp"),
                created=d.get("created", ""),
                budget_s=d.get("budget_s"),
                elapsed_s=d.get("elapsed_s", 0.0),
                skipped=list(d.get("skipped", [])),
            )
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"the profile is missing or mistypes a field ({exc}); take it again") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"{path}: no such profile; make one with `specdec profile`") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not JSON ({exc.msg})") from None
        return cls.from_dict(data)
