"""Prediction against measurement: join two Traces action by action.

    cmp = compare(predicted, measured)
    cmp.summary()      # one line: iteration, bubble, memory errors
    cmp.actions        # per action: predicted/measured start, duration and their errors
    cmp.devices        # per device: busy and idle seconds, bubble, peak memory, both sides
    cmp.iteration      # per metric: predicted, measured, absolute and relative error
    memory_shape(p, m) # one device's memory timelines: where the peak falls, how alike
    alone_scale(p, m, plan)  # what actions cost alone, measured against predicted: the
                             # factors that give a prediction the measured costs

Measured traces usually hold several iterations; actions are compared on the median
over iterations of each action's start and duration (times from its iteration's start).
"""

from __future__ import annotations

import itertools
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
    _check_same_plan(predicted, measured)
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


def alone_actions(trace: Trace, tolerance: float = 0.05) -> pd.DataFrame:
    """Each compute action of ``trace`` and whether it ran alone: for at most ``tolerance``
    of its duration did a compute action of another worker run (same iteration).

    An action alone costs what it costs, with no neighbour slowing it; one that overlaps
    others costs that and whatever sharing the host, device or interpreter did to it.
    Columns: ``iteration, device, stage, microbatch, kind, duration`` (seconds),
    ``overlap`` (share of its duration) and ``alone``::

        worker 0   |== F ==|          |==== B ====|      F alone, B overlapped 0.4
        worker 1            |== F ==|==== B ====|
    """
    a = trace.actions[trace.actions["kind"].isin(COMPUTE_KINDS)]
    frames = []
    for _, it in a.groupby("iteration", sort=False):
        start, end = it["start"].to_numpy(float), it["end"].to_numpy(float)
        device = it["device"].to_numpy()
        # seconds each pair overlaps, counted only between different workers
        shared = np.clip(np.minimum(end[:, None], end[None, :])
                         - np.maximum(start[:, None], start[None, :]), 0.0, None)
        shared[device[:, None] == device[None, :]] = 0.0
        duration = end - start
        overlap = shared.sum(axis=1) / np.maximum(duration, 1e-12)
        frames.append(it[["iteration", "device", "stage", "microbatch", "kind"]].assign(
            duration=duration, overlap=overlap, alone=overlap <= tolerance))
    columns = ["iteration", "device", "stage", "microbatch", "kind", "duration", "overlap",
               "alone"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def alone_scale(predicted: Trace, measured: Trace, plan: Plan, tolerance: float = 0.05
                ) -> tuple[dict[tuple[int, str, int], float], pd.DataFrame]:
    """What each action costs alone, measured against predicted: the factor per action
    for :class:`pipesim.simulator.Jitter`'s ``scale``, and the table it comes from.

    Actions are grouped by stage, kind, micro-batch size and whether it is checkpointed
    (they cost the same); a group's factor is the median duration of its measured actions
    that ran alone (:func:`alone_actions`) over that of its predicted ones.  Simulated
    again with these factors, the prediction has every action's own cost as measured and
    keeps the model's contention, gaps and schedule: what error remains is how actions
    share the machine, not what they cost.  A group alone on neither side or only one
    keeps its cost (factor 1, ``scale`` NaN in the table).  Table columns: ``stage,
    kind, micro_batch, checkpointed, measured_s, predicted_s, measured_n, predicted_n,
    scale``.
    """
    _check_same_plan(predicted, measured, plan)
    sizes = plan.micro_batch_sizes

    def alone(trace: Trace) -> pd.DataFrame:
        t = alone_actions(trace, tolerance)
        t = t[t["alone"]]
        mb = t["microbatch"].astype(int)
        return t.assign(micro_batch=[sizes[m] for m in mb],
                        checkpointed=[plan.checkpointed(m) for m in mb])

    keys = ["stage", "kind", "micro_batch", "checkpointed"]
    sides = [alone(t).groupby(keys)["duration"].agg(["median", "size"])
             for t in (measured, predicted)]
    table = sides[0].merge(sides[1], how="outer", left_index=True, right_index=True,
                           suffixes=("_m", "_p")).reset_index()
    table = table.rename(columns={"median_m": "measured_s", "median_p": "predicted_s",
                                  "size_m": "measured_n", "size_p": "predicted_n"})
    table[["measured_n", "predicted_n"]] = table[["measured_n", "predicted_n"]].fillna(0)
    table["scale"] = table["measured_s"] / table["predicted_s"]
    factor = {(int(r.stage), str(r.kind), int(r.micro_batch), bool(r.checkpointed)): float(r.scale)
              for r in table.itertuples() if np.isfinite(r.scale) and r.scale > 0}
    scale = {}
    for s, kind, m in _actions_of(predicted):
        f = factor.get((s, kind, sizes[m], plan.checkpointed(m)))
        if f is not None:
            scale[(s, kind, m)] = f
    return scale, table


def _actions_of(trace: Trace) -> set[tuple[int, str, int]]:
    """``(stage, kind, microbatch)`` of every compute action in ``trace``."""
    a = trace.actions[trace.actions["kind"].isin(COMPUTE_KINDS)]
    return {(int(s), str(k), int(m)) for s, k, m in
            a[["stage", "kind", "microbatch"]].drop_duplicates().itertuples(index=False)}


def _check_same_plan(predicted: Trace, measured: Trace, plan: Plan | None = None) -> None:
    """Raise :class:`PlanError` where the traces (and ``plan``, if given) are not of one
    schedule, as far as their metadata tell."""
    named = [(name, Plan.from_dict(d)) for name, d in
             (("predicted", predicted.meta.get("plan")), ("measured", measured.meta.get("plan")))
             if d]
    if plan is not None:
        named.append(("the plan given", plan))
    for (name_a, a), (name_b, b) in itertools.pairwise(named):
        if any(getattr(a, f) != getattr(b, f) for f in Plan.SCHEDULE_FIELDS):
            raise PlanError(f"the traces are of different plans: {name_a} {a.label()}, "
                            f"{name_b} {b.label()}")


def _schedule_position(times: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Times (seconds) as positions in a device's run of actions: ``i + f`` while action
    ``i`` (of ``spans``, ``(start, end)`` in order) is ``f`` done, ``i + 1`` from its end
    to the next start; divided by the number of actions (so 0 to 1)."""
    starts, ends = spans[:, 0], spans[:, 1]
    i = np.clip(np.searchsorted(starts, times, side="right") - 1, 0, len(spans) - 1)
    length = np.maximum(ends[i] - starts[i], 1e-12)
    inside = np.clip((times - starts[i]) / length, 0.0, 1.0)
    return (i + np.where(times < starts[i], 0.0, inside)) / len(spans)


def _step_levels(timeline: pd.DataFrame, samples: int,
                 spans: np.ndarray | None = None) -> np.ndarray:
    """Bytes held at ``samples`` evenly spaced instants of one step: from its start (time
    0) to its last memory change, or, given the device's actions, along the schedule
    (:func:`_schedule_position`)."""
    t = timeline["time"].to_numpy(dtype=float)
    b = timeline["bytes"].to_numpy(dtype=float)
    order = np.argsort(t, kind="stable")
    t, b = t[order], b[order]
    if spans is not None and len(spans):
        t, at = _schedule_position(t, spans), np.linspace(0.0, 1.0, samples)
    else:
        at = np.linspace(0.0, float(t[-1]) if len(t) and t[-1] > 0 else 0.0, samples)
    # a level holds from its change to the next one; before the first, the first level
    index = np.clip(np.searchsorted(t, at, side="right") - 1, 0, len(t) - 1)
    return b[index]


def memory_shape(predicted: pd.DataFrame, measured: pd.DataFrame, samples: int = 400,
                 predicted_actions=None, measured_actions=None) -> dict[str, float]:
    """How alike one device's predicted and measured memory timelines are.

    Each is a step's ``memory`` rows of one device (``time`` in seconds from the step's
    start, ``bytes`` held after the change).  Given that device's compute actions on both
    sides (``(start, end)`` pairs in the order it ran them, seconds on the same clock as
    its timeline), each timeline is read along the schedule -- an instant becomes how far
    the device is through its list of actions -- so that actions of other lengths (a
    tracked step runs slower; a prediction may miss a duration) do not move a peak that
    happens in the same action.  Without them, along each step's own time scaled to
    [0, 1].  Returns ``peak_at_pred`` and ``peak_at_meas`` (where each peak first falls,
    0 to 1), ``peak_shift`` (their difference; with actions, 1 / n is one action),
    ``measured_at_predicted_peak`` (the most the measured timeline holds in the action the
    predicted peak falls in -- or, without actions, at that instant -- over the measured
    peak: near-equal peaks of several micro-batches make the argmax jump between them,
    this does not) and ``shape_error`` (the mean over the step of ``|predicted -
    measured|``, relative to the measured peak)::

        bytes                 predicted ----   measured ....
          |        ____                          peak_at_pred 0.45
          |   ____|    |__                       peak_at_meas 0.47
          |__|  ....  ... |___                   shape_error: the gap, step-wide
          +------------------- position in the step
    """
    if predicted.empty or measured.empty:
        raise ValueError("memory_shape needs a timeline on both sides")
    both = predicted_actions is not None and measured_actions is not None
    p = _step_levels(predicted, samples,
                     np.asarray(predicted_actions, dtype=float).reshape(-1, 2) if both else None)
    m = _step_levels(measured, samples,
                     np.asarray(measured_actions, dtype=float).reshape(-1, 2) if both else None)
    peak = float(m.max())
    at = np.linspace(0.0, 1.0, samples)
    top, top_meas = int(np.argmax(p)), int(np.argmax(m))
    if both:  # the samples inside the action the predicted peak falls in
        n = len(predicted_actions)
        action = np.minimum((at * n).astype(int), n - 1)
        held = float(m[action == action[top]].max())
    else:
        held = float(m[top])
    return {"peak_at_pred": float(at[top]),
            "measured_at_predicted_peak": held / peak if peak > 0 else 1.0,
            "peak_at_meas": float(at[top_meas]),
            "peak_shift": float(at[top] - at[top_meas]),
            "shape_error": float(np.mean(np.abs(p - m)) / peak) if peak > 0 else 0.0}
