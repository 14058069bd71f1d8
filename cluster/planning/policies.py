"""The one place the simulator calls the service's policy: every decision the router makes in a
round goes through here, to the router's own plain functions (:mod:`router.policy`), the core's
chunked-prefill plan and per-request k policy, so the planner cannot drift from the service.

The rebalancer (``router/rebalance.py``, plain functions over telemetry) plugs in as
:attr:`RouterPolicy.rebalance`: called every ``rebalance_interval_s`` of simulated time with a
:class:`Telemetry` snapshot per target group; it returns the k_max each group should use next
(or nothing). Until that module is on main the hook is left unset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router import policy
from router.config import RouterConfig
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.prefill_plan import PrefillNeed, plan_prefill
from specdec.core.request_state import CostMeter, KPolicy, RequestState, new_request

__all__ = ["RouterPolicy", "Telemetry"]


@dataclass
class Telemetry:
    """What a rebalancer sees of one target group since its last call."""

    group: int
    t: float
    running: int
    waiting: int
    target_busy: float  # fraction of the interval the target computed
    draft_busy: float  # ... and its draft worker
    cost_c: float  # the router's measured c (draft step / verify)
    acceptance: float  # accepted / drafted over the interval
    k_max: int


RebalanceHook = Callable[[Sequence[Telemetry]], dict[int, int] | None]


def _no_text(ids: list[int]) -> str:
    return ""


@dataclass
class RouterPolicy:
    cfg: RouterConfig
    rebalance: RebalanceHook | None = None
    rebalance_interval_s: float = 5.0
    _kpolicy: dict[int, KPolicy] = field(default_factory=dict)  # per group, after a rebalance

    # ---- admission and batching ----------------------------------------------------------------
    def capacity(self, target_slots: int, draft_slots: int | None) -> int:
        return policy.batch_capacity(target_slots, self.cfg.max_batch, draft_slots)

    def pick_group(self, loads: Sequence[int]) -> int:
        return policy.least_loaded([(False, n) for n in loads])

    def can_admit(self, running: int, capacity: int) -> bool:
        return policy.can_admit(running, capacity)

    def lane_share(self, running: int, lane: int) -> int:
        return policy.lane_share(running, lane, self.cfg.micro_batches, self.cfg.split_min_batch)

    def plan_prefill(self, needs: list[PrefillNeed], verify_tokens: int) -> dict[str, int]:
        return plan_prefill(needs, verify_tokens, self.cfg.max_batched_tokens, self.cfg.prefill_chunk)

    # ---- requests and k ------------------------------------------------------------------------
    def new_request(
        self, key: str, prompt_tokens: int, max_tokens: int, spec: str, has_draft: bool, group: int
    ) -> tuple[RequestState, str, bool]:
        """A request as the router holds it (its real RequestState, k policy and stop rules; token
        ids are placeholders): (state, resolved mode, auto)."""
        spec, auto = policy.resolve_spec(spec, self.cfg.default_mode, has_draft)
        kp = policy.request_k_policy(spec, None, self._kpolicy.get(group, self.cfg.k_policy))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        state = new_request(key, [0] * prompt_tokens, params, VerifyMode.GREEDY, kp, set(), _no_text)
        return state, spec, auto

    def want_k(self, spec: str, auto: bool, running: int, state: RequestState, max_context: int, cost) -> int:
        return policy.want_k(spec, auto, running, self.cfg.auto_off_batch, state, max_context, cost)

    def policy_k(self, state: RequestState) -> int:
        return policy.policy_k(state)

    def predraft_k(self, state: RequestState, k: int, max_context: int) -> int:
        return policy.predraft_k(
            self.policy_k(state), len(state.generated), k, state.params.max_tokens, len(state.tokens), max_context
        )

    def draft_deadline(self, verify_ema: float | None, k: int) -> float:
        return policy.draft_deadline(self.cfg, verify_ema, k)

    def new_cost_meter(self) -> CostMeter:
        return CostMeter(c=self.cfg.k_policy.cost_ratio)

    # ---- rebalancing ---------------------------------------------------------------------------
    def apply_rebalance(self, telemetry: Sequence[Telemetry]) -> None:
        if self.rebalance is None:
            return
        for group, k_max in (self.rebalance(telemetry) or {}).items():
            base = self._kpolicy.get(group, self.cfg.k_policy)
            self._kpolicy[group] = KPolicy(
                k=min(base.k, k_max), adaptive=base.adaptive, k_min=min(base.k_min, k_max), k_max=k_max,
                cost_ratio=base.cost_ratio,
            )  # fmt: skip
