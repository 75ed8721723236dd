"""The partition search at run time: times training steps, asks the chief what to sample
next, reshards every worker to it, and finally settles on the best measured layout.

`after_step` runs at the end of every training step on every worker (a numpy_function the
strategy appends to the step, after its pushes). Steps are counted the same way on every
worker, so all of them reach each decision point at the same step; there the chief's
measurement decides and `broadcast_object` hands its decision to the others.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from parallax.placement.planner import (ClusterProfile, Measurement, PartitionPlanner,
                                        ShardCountEnumerator, TableProfile, fit_report, place)
from parallax.placement.tuning import PartitionSearch, counts_text, next_uniform, save_decision
from parallax.tf.state.resharding import Layout

log = logging.getLogger("parallax")

HOT_IDS = 64  # the most-read ids of each table the placer balances by name


@dataclass
class _Sample:
    layouts: dict[str, tuple[int, ...]]
    measurement: Measurement
    steps: int


class PartitionTuner:
    def __init__(self, config: PartitionSearch, extended, cached: dict | None = None) -> None:
        self.config = config
        self.ext = extended
        self.done = cached is not None
        self.samples: list[_Sample] = []
        self._report: dict = dict(cached["report"], from_cache=True) if cached else {}
        self._durations: list[float] = []
        self._last: float | None = None
        self._search_seconds = 0.0
        self._search_steps = 0
        self._moves: list[dict] = []  # every reshard of the search, on this worker
        self._sampled = 0  # samples finished, on every worker (the chief also keeps them)
        self._traffic_mark: dict[str, tuple[float, float, int, int]] = {}
        self._model_tried = False
        self._confirmed = False  # a near tie of the last two layouts was measured again
        self._skipped: list[dict] = []  # sweep points the model expected too slow
        self._profiles: dict[str, TableProfile] | None = None
        self._memory: int | None = None  # the smallest server's, once profiles are taken
        self._id_counts: dict[str, np.ndarray] = {}

    # ---- every worker, every training step ----

    def after_step(self) -> np.int64:
        now = time.perf_counter()
        if self.done:
            return np.int64(0)
        if self._last is None:  # the first step ran the plan and traced: not a sample
            self._last = now
            return np.int64(0)
        self._durations.append(now - self._last)
        self._last = now
        self._search_seconds += self._durations[-1]
        self._search_steps += 1
        warmup, timed = self._warmup(), self.config.steps_per_sample
        if len(self._durations) == warmup:
            self._mark_traffic()
        if len(self._durations) < warmup + timed:
            return np.int64(0)
        decision = self._decide() if self.ext.workers.info.is_chief else None
        decision = self.ext.workers.broadcast_object(decision)
        self._apply(decision)
        return np.int64(1)

    def _warmup(self) -> int:
        """Untimed steps of the sample under way: the first also lets the job settle (rows
        touched for the first time are initialised on the servers, caches fill)."""
        first = self._sampled == 0  # counted on every worker: decision points must agree
        return self.config.warmup_steps + (self.config.settle_steps if first else 0)

    def _apply(self, decision: dict) -> None:
        """Reshard to the decided layout; the move's time falls into the next (untimed)
        step, or into the overhead once the search is over."""
        layouts = {name: Layout(tuple(servers)) for name, servers in decision["layouts"].items()}
        start = time.perf_counter()
        moved = self.ext.reshard(layouts, log=False, keep_previous=not decision["done"])
        self._moves.append({"tables": len(moved.tables), "rows": moved.rows,
                            "bytes": moved.bytes, "seconds": moved.seconds})
        self._durations = []
        self._sampled += 1
        if self.config.warmup_steps == 0:
            self._mark_traffic()
        if decision["done"]:
            self.ext.release_previous()
            self.done = True
            self._report = decision["report"]
            self._report["final_reshard_seconds"] = time.perf_counter() - start
            self._report["moves"] = self._moves
            self._report["overhead_seconds"] += self._report["final_reshard_seconds"]
            if self.ext.workers.info.is_chief:
                path = save_decision(self.config, self.ext.plan, self._report)
                log.info("%s", describe(self._report, path))

    # ---- measurements (every worker keeps its own; the chief's decide) ----

    def _tables(self):
        plan = self.ext.plan
        return {v.name: (v, self.ext.remotes[v.index]) for v in plan.on_servers}

    def _mark_traffic(self) -> None:
        self._traffic_mark = {}
        for name, (_, remote) in self._tables().items():
            t = remote.traffic
            self._traffic_mark[name] = (t.pull_seconds, t.push_seconds, t.pulls, t.pulled_rows)
            if self._profiles is None and remote.id_sample is None and \
                    self.ext.workers.info.is_chief:
                remote.id_sample = []  # which rows are hot: sampled during the first sample

    def _hot_ids(self, remote) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The most-read rows (after each step's dedup) and their share of all row reads."""
        sample, remote.id_sample = remote.id_sample or [], None
        if not sample or remote.keyed:  # a keyed table's keys route by hash, not by row
            return (), ()
        ids, counts = np.unique(np.concatenate(sample), return_counts=True)
        top = np.argsort(-counts, kind="stable")[:HOT_IDS]
        return (tuple(int(i) for i in ids[top]),
                tuple(float(c) for c in counts[top] / counts.sum()))

    def _measure(self) -> Measurement:
        timed = self._durations[self._warmup():]
        steps = len(timed)
        table_seconds = {}
        for name, (_, remote) in self._tables().items():
            t = remote.traffic
            pull0, push0, _, _ = self._traffic_mark.get(name, (0.0, 0.0, 0, 0))
            table_seconds[name] = max(0.0, (t.pull_seconds - pull0 + t.push_seconds - push0)
                                      / steps)
        counts = {v.name: v.shards for v in self.ext.plan.on_servers}
        step = statistics.median(timed)
        total = sum(table_seconds.values())
        if total > step:  # pulls overlap one another and background pushes overlap the step:
            # share the step out in proportion to the time spent on each table
            table_seconds = {name: t * step / total for name, t in table_seconds.items()}
        return Measurement(counts=counts, step_seconds=step, table_seconds=table_seconds)

    def _table_profiles(self) -> dict[str, TableProfile]:
        if self._profiles is None:
            stats = self.ext.client.stats([v.table for v in self.ext.plan.on_servers])
            held: dict[str, int] = {}
            self._memory = min((r.memory_bytes for r in stats.values() if r.memory_bytes),
                               default=None)
            for reply in stats.values():
                for t in reply.tables:
                    held[t.table] = held.get(t.table, 0) + t.bytes
            profiles = {}
            for name, (vp, remote) in self._tables().items():
                t = remote.traffic
                _, _, pulls0, rows0 = self._traffic_mark.get(name, (0, 0, 0, 0))
                unique = (t.pulled_rows - rows0) / max(1, t.pulls - pulls0)
                hot_ids, hot_shares = self._hot_ids(remote)
                profiles[name] = TableProfile(
                    name=name, rows=remote.rows, dim=remote.dim,
                    bytes=max(held.get(vp.table, 0), vp.bytes),
                    unique_rows_per_step=min(float(remote.rows), unique),
                    hot_ids=hot_ids, hot_shares=hot_shares)
            self._profiles = profiles
        return self._profiles

    # ---- the chief's decisions ----

    def _cluster(self) -> ClusterProfile:
        plan = self.ext.plan
        return ClusterProfile(num_servers=plan.num_servers, num_workers=plan.num_workers,
                              server_memory_bytes=self._memory)

    def _decide(self) -> dict:
        measurement = self._measure()
        profiles = self._table_profiles()
        current = {v.name: v.servers for v in self.ext.plan.on_servers}
        self.samples.append(_Sample(current, measurement,
                                    len(self._durations) - self._warmup()))
        rows = {name: p.rows for name, p in profiles.items()}
        measurements = [s.measurement for s in self.samples]
        counts = next_uniform(self.config, rows, measurements)
        if counts is not None and not self._worth_measuring(counts, measurements):
            counts = None  # the sweep is over: its next point would be slower still
        if counts is not None:
            return {"layouts": self._place(counts), "done": False}
        if not self._model_tried and len(self.samples) < self.config.max_samples:
            self._model_tried = True
            proposal = self._planner().plan(list(profiles.values()), self._cluster(),
                                            measurements)
            if proposal.counts() not in [dict(m.counts) for m in measurements]:
                return {"layouts": self._place(proposal.counts()), "done": False}
        confirm = self._to_confirm()
        if confirm is not None:
            return {"layouts": confirm, "done": False}
        best = min(self._by_layout(), key=lambda s: s.measurement.step_seconds)
        return {"layouts": best.layouts, "done": True, "report": self._final_report(best)}

    def _to_confirm(self) -> dict[str, tuple[int, ...]] | None:
        """A near tie (within `confirm_ratio`) between the last two layouts (the current one
        and the kept one before it) is measured once more: going back costs only the rows
        changed since, and one 15-step sample on a busy machine can be off by 20% (measured:
        ctr 2x2 once read 18% slow on the layout that was best)."""
        if self._confirmed or len(self.samples) < 2:
            return None
        previous, current = self.samples[-2], self.samples[-1]
        ranked = sorted(self._by_layout(), key=lambda s: s.measurement.step_seconds)
        top = {_layout_key(s.layouts) for s in ranked[:2]}
        if top != {_layout_key(previous.layouts), _layout_key(current.layouts)} or \
                ranked[1].measurement.step_seconds > \
                self.config.confirm_ratio * ranked[0].measurement.step_seconds:
            return None
        self._confirmed = True
        return previous.layouts

    def _by_layout(self) -> list[_Sample]:
        """One sample per layout measured, with the mean step time of its measurements."""
        groups: dict[tuple, list[_Sample]] = {}
        for sample in self.samples:
            groups.setdefault(_layout_key(sample.layouts), []).append(sample)
        merged = []
        for samples in groups.values():
            mean = statistics.fmean(s.measurement.step_seconds for s in samples)
            first = samples[0].measurement
            merged.append(_Sample(samples[0].layouts, Measurement(
                first.counts, mean, first.table_seconds), sum(s.steps for s in samples)))
        return merged

    def _worth_measuring(self, counts: Mapping[str, int], measurements) -> bool:
        """Whether the cost model, calibrated on what was measured, expects `counts` to come
        within `stop_ratio` of the best: a sweep point it expects slower than that is not
        worth moving every table for (it is listed in the report as skipped)."""
        estimator = self._planner().estimator
        estimator.calibrate(measurements, list(self._table_profiles().values()),
                            self._cluster())
        predicted = estimator.estimate(counts)
        best = min(m.step_seconds for m in measurements)
        if predicted <= self.config.stop_ratio * best:
            return True
        if all(s["counts"] != dict(counts) for s in self._skipped):
            self._skipped.append({"counts": dict(counts), "predicted_step_seconds": predicted})
        return False

    def _planner(self) -> PartitionPlanner:
        enumerator = ShardCountEnumerator(min_shards=self.config.min_shards,
                                          max_shards=self.config.max_shards)
        return PartitionPlanner(enumerator=enumerator, time_budget_seconds=self.config.plan_seconds)

    def _place(self, counts: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Servers for `counts`; tables whose count stays keep their servers (moves are the
        expensive part of a sample)."""
        current = {v.name: v.servers for v in self.ext.plan.on_servers}
        plan = place(counts, list(self._table_profiles().values()), self._cluster(),
                     keep=current)
        return {t.name: tuple(t.servers) for t in plan.tables}

    def _final_report(self, best: _Sample) -> dict:
        chosen = best.measurement.step_seconds
        planner = self._planner()
        profiles = list(self._table_profiles().values())
        measurements = [s.measurement for s in self.samples]
        cluster = self._cluster()
        planner.estimator.calibrate(measurements, profiles, cluster)
        candidates = {p.name: planner.enumerator.candidates(p, cluster) for p in profiles}
        curve = [[n, seconds] for n, seconds in fit_report(planner.estimator, candidates)]
        return {
            "samples": [{"counts": dict(s.measurement.counts), "servers": s.layouts,
                         "step_seconds": s.measurement.step_seconds, "steps": s.steps,
                         "table_seconds": dict(s.measurement.table_seconds)}
                        for s in self.samples],
            "chosen": dict(best.measurement.counts),
            "servers": {k: list(v) for k, v in best.layouts.items()},
            "chosen_step_seconds": chosen,
            "search_steps": self._search_steps,
            "search_seconds": self._search_seconds,
            "overhead_seconds": max(0.0, self._search_seconds - self._search_steps * chosen),
            "fitted_curve": curve,
            "skipped": self._skipped,
            "fit_residual": planner.estimator.residual(),
            "decided_at_step": self._search_steps + 1,
            "from_cache": False,
        }

    def report(self) -> dict:
        return dict(self._report)


def _layout_key(layouts: Mapping[str, tuple[int, ...]]) -> tuple:
    return tuple(sorted((name, tuple(servers)) for name, servers in layouts.items()))


def describe(report: dict, path) -> str:
    chosen = ", ".join(f"{k}: {n} @ {','.join(map(str, report['servers'][k]))}"
                       for k, n in report["chosen"].items())
    tried = "; ".join(f"{counts_text(s['counts'])} {s['step_seconds'] * 1e3:.1f} ms"
                      for s in report["samples"])
    where = f"; saved to {path}" if path else ""
    return (f"parallax: partition search chose {chosen} ({report['chosen_step_seconds'] * 1e3:.1f}"
            f" ms/step) after {len(report['samples'])} samples over {report['search_steps']} "
            f"steps [{tried}]; overhead {report['overhead_seconds']:.2f} s{where}")

