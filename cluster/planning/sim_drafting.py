"""Where the simulator's drafts come from: ``router.drafting.DraftSource`` step by step over simulated
draft workers. Each request drafts where the router's own drafter pool (``router.drafter_pool``,
with the rebalancer's ``assign_drafter``) places it; the pool measures every Propose's wait as in
the service (queueing included), and those measurements drive placement and the speculation switch.
A late draft fails open and keeps its drafter busy; a drafter still busy with a late draft fails
the next rounds open at once; pre-drafts go out during the verify when the depth level allows (on
a colocated device the two then share it).

Not modelled: the pool coalescing Proposes that wait for a busy drafter into one call (here they
run one after the other, as without coalescing).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from cluster.planning.sim_entities import Call, Group, Job, PreDraft, SimClient, Until

__all__ = ["SimDrafting"]


class SimDrafting:
    def __init__(self, sim: Any, drafters: dict[str, SimClient]):
        self.sim = sim  # the simulation: now, at(), costs, policy (P), pool, rng, sample()
        self.drafters = drafters
        self.prefills: list[tuple[Call, int]] = []  # each draft Prefill and its new tokens (the split's)
        self.prefilling: list[tuple[Call, int, int, int]] = []  # Proposes that prefill: tokens, rows, steps

    # ---- placement -----------------------------------------------------------------------------
    def assign(self, g: Group, job: Job) -> str | None:
        """DraftSource._assign: the pool's placement; a request that moved rebuilds its cache there."""
        pool = self.sim.pool
        if pool is None:
            return None
        name = pool.assign(job, g.home, g.target.name)
        if job.moved_from is not None:
            job.draft_cached = 0
        return name

    # ---- the draft side of a prefill -------------------------------------------------------------
    def prefill(self, g: Group, chunks: list[Job], plan: dict[str, int]) -> None:
        """The drafters cache the same prompt chunks, unawaited, in one Prefill per drafter (not a
        prompt's last chunk: that one goes with the first Propose; nothing for a request that starts
        switched off)."""
        new: dict[str, int] = {}
        for j in chunks:
            if j.spec != "draft" or j.spec_off or plan[j.key] >= j.state.prefill_total:
                continue
            name = self.assign(g, j)
            if name is None:
                continue
            j.drafters.add(name)
            new[name] = new.get(name, 0) + plan[j.key] - j.draft_cached
            j.draft_cached = plan[j.key]
        for name, tokens in new.items():
            self._prefill(name, tokens)

    def _prefill(self, name: str, tokens: int) -> None:
        """One draft Prefill of ``tokens`` new tokens on ``name``, unawaited; the pool prices it."""
        sim = self.sim
        call = self.drafters[name].submit(sim.costs.draft_rpc_s + sim.costs.draft_prefill_s(tokens))
        call.on_done(lambda: sim.pool.observe_prefill(name, call.end - call.start - sim.costs.draft_rpc_s, tokens))
        self.prefills.append((call, tokens))

    def prefill_split(self) -> dict[str, float]:
        """The split's draft prefill fields, as bench serve scrapes the service's: the Prefills (calls,
        the worker's time per call, stretched where it shared the device, new tokens per call) and
        the Proposes that prefill (the same, with their rows and draft steps)."""
        rpc, out = self.sim.costs.draft_rpc_s, {}
        done = [(c, n) for c, n in self.prefills if c.done]
        if done:
            out["draft_prefills"] = len(done)
            out["draft_prefill_compute_ms"] = round(1e3 * sum(c.end - c.start - rpc for c, _ in done) / len(done), 3)
            out["draft_prefill_tokens"] = round(sum(n for _, n in done) / len(done), 3)
        proposes = [p for p in self.prefilling if p[0].done]
        if proposes:
            n = len(proposes)
            out["prefilling_proposes"] = n
            out["prefilling_propose_compute_ms"] = round(1e3 * sum(c.end - c.start - rpc for c, *_ in proposes) / n, 3)
            for i, what in enumerate(("tokens", "rows", "steps"), start=1):
                out[f"prefilling_propose_{what}"] = round(sum(p[i] for p in proposes) / n, 3)
        return out

    # ---- a round's drafts --------------------------------------------------------------------------
    def _fail_open(self, g: Group, j: Job) -> None:
        j.state.stats.fail_open_rounds += 1
        g.fail_open += 1

    def _catch_up(self, j: Job, name: str) -> bool:
        """DraftSource._catch_up: a request back from decoding without speculation sends its drafter
        a Prefill (unawaited) and verifies this round without a draft."""
        sim = self.sim
        new = len(j.state.tokens) - j.draft_cached
        if not j.state.generated or new <= sim.P.cfg.k_policy.k_max + 1:
            return False
        j.drafters.add(name)
        self._prefill(name, new)
        j.draft_cached = len(j.state.tokens)
        return True

    def _propose(self, name: str, jobs: list[Job], k: int, predraft: bool = False) -> Call:
        """Send one Propose for ``jobs`` to ``name`` now: the pool measures it when it returns."""
        sim = self.sim
        d = self.drafters[name]
        context = max(len(j.state.tokens) for j in jobs)
        dur = sim.costs.draft_rpc_s + sim.costs.draft_s(len(jobs), k, context)
        # DraftSource._feed: more new tokens than a round commits (a prompt's tail, a moved request,
        # catching up after speculation was off) is a prefill there, and the pool does not measure it
        new = [len(j.state.tokens) - j.draft_cached for j in jobs]
        catch_up = sum(n for n in new if n > sim.P.cfg.k_policy.k_max + 1)
        if catch_up:
            dur += sim.costs.draft_prefill_s(catch_up)
        for j in jobs:
            j.draft_cached = len(j.state.tokens)
        measured, t_req = sim.pool.begin(name, 0 if catch_up else k), sim.now
        call = d.submit(dur)
        if catch_up and not predraft:
            self.prefilling.append((call, catch_up, len(jobs), k))

        def done() -> None:
            sim.pool.end(name, measured, True, since=t_req, started=call.start)
            if catch_up:
                sim.pool.observe_prefill(name, call.end - call.start - sim.costs.draft_rpc_s, catch_up, k)

        call.on_done(done)
        return call

    def drafts(self, g: Group, batch: list[Job], ks: list[int]) -> Generator:
        """DraftSource.drafts: the tokens drafted per job (0 where the round fails open)."""
        sim = self.sim
        drafted = [0] * len(batch)
        for j in batch:
            j.outcome = (0, 0, False)
        remote: dict[str, list[int]] = {}
        pending: list[tuple[int, PreDraft]] = []
        for i, (j, k) in enumerate(zip(batch, ks)):
            pd, j.predraft = j.predraft, None
            if k <= 0:
                continue
            if j.spec == "ngram":
                drafted[i] = sim.sample(j, k)
            elif j.spec == "draft":
                name = self.assign(g, j)
                if name is None:
                    self._fail_open(g, j)
                elif self._catch_up(j, name):
                    continue
                elif pd is not None and pd.drafter == name and j.last_all_accepted:
                    pending.append((i, pd))
                else:
                    if pd is not None:
                        g.predraft_misses += 1
                    remote.setdefault(name, []).append(i)
        if not remote and not pending:
            return drafted
        t_end = sim.now + sim.P.draft_deadline(g.verify_ema, max(ks))
        for i, pd in pending:  # pre-drafts first: they already run on their drafters
            j = batch[i]
            yield Until([pd.call], t_end)
            if pd.call.done:
                hit = j.last_bonus_match and pd.k > 0
            else:
                d = self.drafters[pd.drafter].worker
                if not d.late_busy:
                    d.late = pd.call
                hit = False
            if hit:
                drafted[i] = sim.sample(j, min(ks[i], pd.k))
                g.predraft_hits += 1
            else:
                g.predraft_misses += 1
                remote.setdefault(pd.drafter, []).append(i)
        ok: dict[str, bool] = {}
        calls: dict[str, Call] = {}
        unsent = False
        for name, idx in remote.items():
            w = self.drafters[name].worker
            for i in idx:
                batch[i].drafters.add(name)
            ok[name] = False
            if w.late_busy:  # busy with a late draft: fail open now
                continue
            if w.free_at() > t_end:  # would queue past the deadline: never sent
                unsent = True
            else:
                calls[name] = self._propose(name, [batch[i] for i in idx], max(ks[i] for i in idx))
        if unsent:
            yield t_end
        elif calls:
            yield Until(list(calls.values()), t_end)
        for name, call in calls.items():
            ok[name] = call.done
            if not call.done:
                self.drafters[name].worker.late = call
        for name, idx in remote.items():
            for i in idx:
                if ok[name]:
                    drafted[i] = sim.sample(batch[i], ks[i])
                else:
                    self._fail_open(g, batch[i])
        return drafted

    def launch_predraft(self, g: Group, batch: list[Job], ks: list[int], drafted: list[int], enabled: bool) -> None:
        """DraftSource.launch_predraft: draft round r+1 on the all-accepted guess during the verify."""
        sim = self.sim
        if not enabled or sim.pool is None:
            return
        groups: dict[str, list[tuple[Job, int]]] = {}
        rooms: dict[str, int | None] = {}
        for j, k, d in zip(batch, ks, drafted):
            if j.spec != "draft" or k <= 0 or d != k or j.drafter is None:
                continue
            client = self.drafters.get(j.drafter)
            if client is None or not client.up or client.worker.late_busy:
                continue
            if j.drafter not in rooms:
                rooms[j.drafter] = sim.P.predraft_room(sim.pool.view_of(j.drafter, g.target.name), g.verify_ema)
            k_next = sim.P.predraft_k(j.state, k, sim.dep.max_context, rooms[j.drafter])
            if k_next > 0:
                groups.setdefault(j.drafter, []).append((j, k_next))
        for name, picked in groups.items():
            call = self._propose(name, [j for j, _ in picked], max(k for _, k in picked) + 1, predraft=True)
            for j, k_next in picked:
                j.predraft = PreDraft(name, call, k_next)
