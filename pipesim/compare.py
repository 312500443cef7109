"""Prediction against measurement: join two Traces action by action.

    cmp = compare(predicted, measured)
    cmp.summary()      # one line: iteration, bubble, memory errors
    cmp.actions        # per action: predicted/measured start, duration and their errors
    cmp.devices        # per device: busy and idle seconds, bubble, peak memory, both sides
    cmp.iteration      # per metric: predicted, measured, absolute and relative error

Measured traces usually hold several iterations; actions are compared on the median
over iterations of each action's start and duration (times from its iteration's start).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipesim.errors import PlanError, ScheduleError
from pipesim.plan import Plan
from pipesim.trace import COMPUTE_KINDS, Metrics, Trace, metrics

_KEY = ["stage", "microbatch", "kind"]


def _per_action(trace: Trace) -> pd.DataFrame:
    """Median start (from its iteration's origin) and duration of each compute action."""
    a = trace.actions[trace.actions["kind"].isin(COMPUTE_KINDS)].copy()
    origin = a.groupby("iteration")["start"].transform("min")
    a["rel_start"] = a["start"] - origin
    a["duration"] = a["end"] - a["start"]
    return a.groupby([*_KEY, "device"], as_index=False)[["rel_start", "duration"]].median()


@dataclass
class Comparison:
    """Errors of a prediction; every frame is tidy (one row per thing compared)."""

    predicted: Metrics
    measured: Metrics
    actions: pd.DataFrame
    devices: pd.DataFrame
    iteration: pd.DataFrame

    def error(self, metric: str) -> float:
        """Relative error (predicted / measured - 1) of an iteration metric."""
        return float(self.iteration.set_index("metric").loc[metric, "rel_error"])

    def summary(self) -> str:
        it = self.iteration.set_index("metric")
        parts = [f"iteration {it.loc['iteration_time_s', 'predicted'] * 1e3:.2f} ms predicted vs "
                 f"{it.loc['iteration_time_s', 'measured'] * 1e3:.2f} ms measured "
                 f"({it.loc['iteration_time_s', 'rel_error']:+.1%})",
                 f"bubble {it.loc['mean_bubble', 'predicted']:.1%} vs "
                 f"{it.loc['mean_bubble', 'measured']:.1%}",
                 f"median action duration error "
                 f"{self.actions['duration_rel_error'].abs().median():.1%}"]
        if "peak_memory_bytes" in it.index and np.isfinite(it.loc["peak_memory_bytes", "measured"]):
            parts.append(f"peak memory {it.loc['peak_memory_bytes', 'rel_error']:+.1%}")
        return "; ".join(parts)


def compare(predicted: Trace, measured: Trace) -> Comparison:
    """Join ``predicted`` and ``measured`` by (stage, micro-batch, kind); see module doc."""
    dicts = [t.meta.get("plan") for t in (predicted, measured)]
    if dicts[0] and dicts[1]:
        a, b = Plan.from_dict(dicts[0]), Plan.from_dict(dicts[1])
        if any(getattr(a, f) != getattr(b, f) for f in Plan.SCHEDULE_FIELDS):
            raise PlanError(f"the traces are of different plans: predicted {a.label()}, "
                            f"measured {b.label()}")
    pm, mm = metrics(predicted), metrics(measured)
    p, m = _per_action(predicted), _per_action(measured)
    missing = set(map(tuple, m[_KEY].to_numpy())) ^ set(map(tuple, p[_KEY].to_numpy()))
    if missing:
        raise ScheduleError(f"the traces hold different actions, e.g. {sorted(missing)[:3]}: were "
                            "they made from the same schedule?")
    actions = p.merge(m, on=[*_KEY, "device"], suffixes=("_pred", "_meas"))
    actions["duration_error_s"] = actions["duration_pred"] - actions["duration_meas"]
    actions["duration_rel_error"] = actions["duration_error_s"] / actions["duration_meas"]
    actions["start_error_s"] = actions["rel_start_pred"] - actions["rel_start_meas"]
    devices = pd.DataFrame({
        "device": sorted(pm.busy_s),
        "busy_pred_s": [pm.busy_s[d] for d in sorted(pm.busy_s)],
        "busy_meas_s": [mm.busy_s.get(d, np.nan) for d in sorted(pm.busy_s)],
        "bubble_pred": [pm.bubble[d] for d in sorted(pm.busy_s)],
        "bubble_meas": [mm.bubble.get(d, np.nan) for d in sorted(pm.busy_s)],
    })
    devices["idle_pred_s"] = pm.iteration_time_s - devices["busy_pred_s"]
    devices["idle_meas_s"] = mm.iteration_time_s - devices["busy_meas_s"]
    devices["busy_rel_error"] = devices["busy_pred_s"] / devices["busy_meas_s"] - 1
    rows = [("iteration_time_s", pm.iteration_time_s, mm.iteration_time_s),
            ("throughput", pm.throughput, mm.throughput),
            ("mean_bubble", pm.mean_bubble, mm.mean_bubble)]
    peak_p = max(pm.peak_memory_bytes.values(), default=np.nan)
    peak_m = max(mm.peak_memory_bytes.values(), default=np.nan)
    rows.append(("peak_memory_bytes", peak_p, peak_m))
    iteration = pd.DataFrame(rows, columns=["metric", "predicted", "measured"])
    iteration["abs_error"] = iteration["predicted"] - iteration["measured"]
    iteration["rel_error"] = iteration["predicted"] / iteration["measured"] - 1
    return Comparison(pm, mm, actions, devices, iteration)
