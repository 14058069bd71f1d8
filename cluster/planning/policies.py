"""The one place the simulator reaches the service's policy: every decision the router makes goes
through here, to the router's own code: the scheduler's plain functions (:mod:`router.policy`),
the core's chunked-prefill plan and per-request k policy, and the rebalancer (its plain functions in
:mod:`router.rebalance`, applied by the router's own ``TargetBalance`` and ``DrafterPool``, which run
here on the simulated clock). So the planner cannot drift from the service.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router import policy
from router.config import RouterConfig
from router.drafter_pool import DrafterPool
from router.metrics import Metrics
from router.rebalance import DrafterView, TargetView, pick_target, predraft_room
from router.target_balance import TargetBalance
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.prefill_plan import PrefillNeed, plan_prefill
from specdec.core.request_state import CostMeter, RequestState, new_request

__all__ = ["RouterPolicy"]


def _no_text(ids: list[int]) -> str:
    return ""


@dataclass
class RouterPolicy:
    cfg: RouterConfig
    metrics: Metrics = field(default_factory=Metrics)  # where the router's balance code counts its actions

    # ---- admission, routing and batching -------------------------------------------------------
    def capacity(self, target_slots: int, draft_slots: int | None) -> int:
        return policy.batch_capacity(target_slots, self.cfg.max_batch, draft_slots)

    def pick_target(self, views: Sequence[TargetView]) -> int:
        return pick_target(views, self.cfg.rebalance).index

    def can_admit(self, running: int, capacity: int) -> bool:
        return policy.can_admit(running, capacity)

    def lane_share(self, running: int, lane: int) -> int:
        return policy.lane_share(running, lane, self.cfg.micro_batches, self.cfg.split_min_batch)

    def plan_prefill(self, needs: list[PrefillNeed], verify_tokens: int, budget: int) -> dict[str, int]:
        return plan_prefill(needs, verify_tokens, budget, self.cfg.prefill_chunk)

    # ---- requests and k ------------------------------------------------------------------------
    def new_request(
        self, key: str, prompt_tokens: int, max_tokens: int, spec: str, has_draft: bool
    ) -> tuple[RequestState, str, bool]:
        """A request as the router holds it (its real RequestState, k policy and stop rules; token
        ids are placeholders): (state, resolved mode, auto)."""
        spec, auto = policy.resolve_spec(spec, self.cfg.default_mode, has_draft)
        kp = policy.request_k_policy(spec, None, self.cfg.k_policy)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        state = new_request(key, [0] * prompt_tokens, params, VerifyMode.GREEDY, kp, set(), _no_text)
        return state, spec, auto

    def policy_k(self, state: RequestState) -> int:
        return policy.policy_k(state)

    def predraft_k(self, state: RequestState, k: int, max_context: int, room: int | None) -> int:
        return policy.predraft_k(
            self.policy_k(state), len(state.generated), k, state.params.max_tokens, len(state.tokens), max_context, room
        )

    def predraft_room(self, drafter: DrafterView | None, verify_s: float | None) -> int | None:
        return predraft_room(drafter, verify_s)

    def draft_deadline(self, verify_ema: float | None, k: int) -> float:
        return policy.draft_deadline(self.cfg, verify_ema, k)

    def new_cost_meter(self) -> CostMeter:
        return CostMeter(c=self.cfg.k_policy.cost_ratio)

    # ---- the rebalancer's appliers, on the simulated clock -----------------------------------------
    def new_pool(self, clock: Callable[[], float]) -> DrafterPool:
        return DrafterPool(self.cfg, self.metrics, clock=clock)

    def new_balance(self, group: Any, clock: Callable[[], float]) -> TargetBalance:
        return TargetBalance(group, clock=clock)

    @property
    def rebalance_period_s(self) -> float | None:
        return self.cfg.rebalance.period_s if self.cfg.rebalance.enabled else None
