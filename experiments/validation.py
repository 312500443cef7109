"""Shared pieces of the validation experiments (CPU processes and GPU).

``predict_and_measure`` runs a grid of plans, ``summarise`` prints the error figures the
issues ask for, ``confirm_choice`` re-measures the tuner's pick against the fastest plan
measured, ``replay_error`` feeds a run's own measured durations back into the
simulator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.compare import alone_scale, compare
from pipesim.plan import V_SCHEDULES, Plan
from pipesim.profile import Profile
from pipesim.readings import CheckpointExtra, ExecutorGap, IdleCost, InPlaceCost, RunOnCost, in_place_costs_of
from pipesim.schedule import program
from pipesim.simulator import Jitter, simulate
from pipesim.trace import Trace, metrics

Measure = Callable[[list[Plan]], list[Trace]]
#: rows measured in place that the grids bracket: a reading before and after each grid
Reading = TypeVar("Reading", CheckpointExtra, ExecutorGap, InPlaceCost, IdleCost)


def grid(profile: Profile, n_stages: int, batch: int, chunks=(1, 2, 4, 8, 16),
         checkpoints=("never", "except_last", "always"), schedules=("gpipe", "1f1b"),
         skew: bool = True) -> list[Plan]:
    """Balanced (exact partition) and skewed balances x chunks x checkpoint x schedule.

    Plans say ``optimizer="sgd"``: the executor runs forward and backward only and holds
    no optimizer state, so that is what its memory is compared with.
    """
    size = max(1, batch // 4)

    def balances(stages: int) -> list[list[int]]:
        balanced = min_max_partition(profile.layer_times(size), stages)
        out = [balanced]
        if skew:
            skewed = [1] * (stages - 1) + [profile.n_layers - stages + 1]
            if skewed == balanced:
                skewed = [profile.n_layers - stages + 1] + [1] * (stages - 1)
            out.append(skewed)
        return out

    plans = []
    for s in schedules:
        v = 2 if s in V_SCHEDULES else 1  # a V: two stages a device
        if n_stages * v > profile.n_layers:
            continue
        plans += [Plan(b, c, batch, checkpoint=k, schedule=s, virtual_stages=v, optimizer="sgd")
                  for b in balances(n_stages * v) for c in chunks if c <= batch
                  for k in checkpoints]
    return plans


def paired(plans: Sequence[Plan]) -> list[Plan]:
    """``plans`` reordered so that each plan's schedules run one after another: GPipe,
    1F1B, ... of one balance, micro-batch count and checkpoint mode side by side, in the
    order they first appear.  A host whose speed drifts over minutes (the 16-core hosts of
    the GPU machines, 2026-11-27) then reads as noise between twins, not as one
    schedule's bias: a grid measured in its built order runs every GPipe plan first::

        grid order    gpipe[a,1] gpipe[a,2] ... gpipe[b,16]  1f1b[a,1] ... 1f1b[b,16]
        paired        gpipe[a,1] 1f1b[a,1]  gpipe[a,2] 1f1b[a,2] ...
    """
    first: dict[tuple, int] = {}
    for i, p in enumerate(plans):
        first.setdefault((tuple(p.balance), p.chunks, p.checkpoint), i)
    return sorted(plans, key=lambda p: first[(tuple(p.balance), p.chunks, p.checkpoint)])


#: optional profile columns behind one mechanism each (for ablations)
CHECKPOINT_COSTS = ("ckpt_fwd_s", "ckpt_bwd_s")
TRANSIENTS = ("fwd_transient_bytes", "bwd_transient_bytes", "bwd_rise_bytes", "bwd_fed_rise_bytes")


def without_columns(profile: Profile, columns: tuple[str, ...]) -> Profile:
    """``profile`` without some optional columns: the model as it was before them (without
    CHECKPOINT_COSTS checkpointing costs one more forward and nothing else; without
    TRANSIENTS nothing is held beyond what is saved)."""
    return Profile(profile.table.drop(columns=list(columns), errors="ignore"), profile.meta,
                   profile.source)


def predict_and_measure(profile: Profile, plans: list[Plan], cluster: Cluster,
                        measure: Measure, label: str,
                        ablations: dict[str, tuple[Profile, Cluster]] | None = None,
                        ) -> tuple[pd.DataFrame, list[Trace]]:
    """Run ``plans``, predict each; ``ablations`` (name -> profile, cluster) add a column
    ``predicted_ms_NAME`` each: the same plan predicted with one mechanism taken out."""
    measured = measure(plans)
    return predicted_against(profile, plans, cluster, measured, label, ablations), measured


def predicted_against(profile: Profile, plans: list[Plan], cluster: Cluster,
                      measured: list[Trace], label: str,
                      ablations: dict[str, tuple[Profile, Cluster]] | None = None
                      ) -> pd.DataFrame:
    """The table of :func:`predict_and_measure` for runs already measured; beside the
    prediction, ``alone_costs_ms``: the same model with each action at the cost it had
    where it ran alone in the run (:func:`pipesim.compare.alone_scale`; not a prediction:
    what error is left once the actions cost what they did, the model's sharing's)."""
    rows = []
    for plan, trace in zip(plans, measured, strict=True):
        predicted = simulate(profile, plan, cluster)
        cmp = compare(predicted, trace)
        it = cmp.iteration.set_index("metric")
        alone, _ = with_alone_costs(profile, plan, cluster, predicted, trace)
        rows.append({
            **plan_columns(label, plan),
            "predicted_ms": it.loc["iteration_time_s", "predicted"] * 1e3,
            "measured_ms": it.loc["iteration_time_s", "measured"] * 1e3,
            **pass_columns(trace),
            "error_pct": 100 * it.loc["iteration_time_s", "rel_error"],
            "bubble_pred": it.loc["mean_bubble", "predicted"],
            "bubble_meas": it.loc["mean_bubble", "measured"],
            "throughput_pred": it.loc["throughput", "predicted"],
            "throughput_meas": it.loc["throughput", "measured"],
            "peak_pred_bytes": it.loc["peak_memory_bytes", "predicted"],
            "peak_meas_bytes": it.loc["peak_memory_bytes", "measured"],
            "action_duration_error_pct": 100 * cmp.actions["duration_rel_error"].median(),
            "alone_costs_ms": 1e3 * alone,
            "reference_ms": reference_ms(trace),
            **{f"predicted_ms_{name}": 1e3 * metrics(simulate(p, plan, c, track_memory=False))
               .iteration_time_s for name, (p, c) in (ablations or {}).items()},
        })
    return pd.DataFrame(rows)


def with_alone_costs(profile: Profile, plan: Plan, cluster: Cluster, predicted: Trace,
                     measured: Trace) -> tuple[float, pd.DataFrame]:
    """Iteration seconds of ``plan`` simulated with each action at the cost it had where it
    ran alone in ``measured`` against ``predicted`` (:func:`pipesim.compare.alone_scale`,
    whose table comes back beside them): the model's sharing, gaps and schedule with the
    run's own costs."""
    scale, table = alone_scale(predicted, measured, plan)
    trace = simulate(profile, plan, cluster, track_memory=False, jitter=Jitter(scale=scale))
    return metrics(trace).iteration_time_s, table


def reference_ms(trace: Trace) -> float:
    """The machine's speed reference (ms) read beside a measured plan: the mean over its
    passes (:func:`in_passes`) of ``meta["reference_s"]``
    (``executor.distributed.spawn_plans(..., reference=True)``); NaN where none was read."""
    readings = trace.meta.get("pass_reference_s") or (
        [trace.meta["reference_s"]] if "reference_s" in trace.meta else [])
    return 1e3 * float(np.mean(readings)) if readings else math.nan


def drift_tracked(table: pd.DataFrame, column: str = "predicted_ms") -> pd.Series:
    """Each plan's prediction (``column``) scaled by how fast the machine ran while it was
    measured: ``column * reference_ms / median(reference_ms)`` over the model's plans (the
    grid's own reference readings, :func:`reference_ms`; the profile, taken before and
    after the grid, stands for the grid's median speed).  Not a prediction: the plan's
    error with the machine's drift during the grid taken out, read by a fixed piece of
    work and not by the plans; NaN where no reference was read."""
    if "reference_ms" not in table:
        return pd.Series(math.nan, index=table.index)
    median = table.groupby("model").reference_ms.transform("median")
    return table[column] * table.reference_ms / median


#: the columns of a grid's table that name its row: the model and the plan
PLAN_COLUMNS = ("model", "balance", "chunks", "checkpoint", "schedule")


def plan_columns(label: str, plan: Plan) -> dict:
    """The columns that name a grid's row (:data:`PLAN_COLUMNS`): its model (``label``)
    and plan (``balance`` as ``"3,3"``, ``chunks``, ``checkpoint``, ``schedule``), as
    :func:`noise_floor` reads them; :func:`row_plan` is the way back."""
    return {"model": label, "balance": ",".join(map(str, plan.balance)), "chunks": plan.chunks,
            "checkpoint": plan.checkpoint, "schedule": plan.schedule}


def row_plan(row: Any, batch: int) -> Plan:
    """The Plan of a grid's row (:func:`plan_columns`; a ``virtual_stages`` field where
    interleaved) for ``batch`` samples."""
    balance = row.balance.split(",") if isinstance(row.balance, str) else row.balance
    return Plan([int(b) for b in balance], int(row.chunks), batch, checkpoint=row.checkpoint,
                schedule=row.schedule, virtual_stages=int(getattr(row, "virtual_stages", 1) or 1))


def measured_table(label: str, plans: list[Plan], measured: list[Trace]) -> pd.DataFrame:
    """The grid's rows as measured, before any prediction: what :func:`predicted_against`
    writes of the runs themselves (milliseconds, fractions, samples per second, bytes).
    Saved first, so that a run cut before its predictions can be predicted later
    (:func:`predict_saved`)."""
    rows = []
    for plan, trace in zip(plans, measured, strict=True):
        m = metrics(trace)
        rows.append({**plan_columns(label, plan), "measured_ms": 1e3 * m.iteration_time_s,
                     **pass_columns(trace), "reference_ms": reference_ms(trace),
                     "bubble_meas": m.mean_bubble, "throughput_meas": m.throughput,
                     "peak_meas_bytes": max(m.peak_memory_bytes.values(), default=float("nan"))})
    return pd.DataFrame(rows)


def save_measured_actions(path: Path, label: str, plans: list[Plan],
                          traces: list[Trace]) -> None:
    """Append every plan's measured actions to one CSV (``path``, gzip when it ends so),
    keyed by ``model`` and the plan's label: the raw durations behind a grid, kept so the
    cost model can be studied later without the machine that ran it."""
    frames = [t.actions.assign(model=label, plan=plan.label())
              for plan, t in zip(plans, traces, strict=True)]
    table = pd.concat(frames, ignore_index=True)
    table.to_csv(path, index=False, mode="a" if path.exists() else "w",
                 header=not path.exists())


def load_measured_actions(path: Path) -> dict[tuple[str, str], pd.DataFrame]:
    """What :func:`save_measured_actions` wrote, per ``(model, plan label)``: each plan's
    measured actions (:func:`measured_trace` makes them a Trace again)."""
    actions = pd.read_csv(path)
    return {(str(model), str(plan)): part.drop(columns=["model", "plan"]).reset_index(drop=True)
            for (model, plan), part in actions.groupby(["model", "plan"])}


def measured_trace(actions: pd.DataFrame, plan: Plan) -> Trace:
    """The measured Trace of ``plan`` from its saved actions (:func:`load_measured_actions`)."""
    return Trace(actions, meta={"plan": plan.to_dict(), "batch_size": plan.batch_size})


def replay_error(profile: Profile, plan: Plan, measured: Trace, cluster: Cluster) -> float:
    """Relative error of the simulator replaying the run's own median action durations.

    Durations come from the run, whatever sharing did to them included: so nothing is
    shared again -- no host contention, and workers that shared a device (threads on one
    GPU) each get one of their own, in no common process (interpreter, autograd engine).
    Links and the gaps between actions come from calibration.
    """
    a = measured.actions[measured.actions.kind.isin(["F", "B"])]
    med = (a.assign(d=a.end - a.start).groupby(["stage", "kind", "microbatch"])["d"].median())
    durations = {k: float(v) for k, v in med.items()}
    own = [dataclasses.replace(d, physical=f"{d.physical}/{d.name}" if d.physical else "",
                               process="") for d in cluster.devices]
    replay_cluster = dataclasses.replace(cluster, host_contention=0.0, devices=own)
    replay = metrics(simulate(profile, plan, replay_cluster, durations=durations)).iteration_time_s
    return replay / metrics(measured).iteration_time_s - 1


def program_groups(table: pd.DataFrame, batch: int | None = None) -> pd.Series:
    """Per row of a grid's table (``PLAN_COLUMNS``; a ``virtual_stages`` column where
    interleaved): a number shared by the rows whose plans run the same program
    (:func:`pipesim.schedule.program`: GPipe and 1F1B, ``except_last`` and ``never``, at
    one micro-batch), so that a choice among them is judged as one plan, not by which of
    its measurements came out fastest.  ``batch`` defaults to the table's largest chunk
    count (every micro-batch one sample: the same groups wherever the batch splits
    evenly).  A table without the columns: each row its own group."""
    if not set(PLAN_COLUMNS) <= set(table.columns):
        return pd.Series(range(len(table)), index=table.index)
    batch = batch or int(table.chunks.max())
    keys: dict[tuple, int] = {}
    out = []
    for r in table.itertuples():
        out.append(keys.setdefault((r.model, program(row_plan(r, batch))), len(keys)))
    return pd.Series(out, index=table.index)


def chosen_regret(part: pd.DataFrame) -> float:
    """What choosing the best-predicted plan of one model's grid ``part`` costs against
    the best measured (a share of throughput: 0.02 is 2%), each plan judged by the mean
    measured throughput of the rows that run its program (:func:`program_groups`)."""
    by_program = part.throughput_meas.groupby(program_groups(part)).transform("mean")
    return float(1 - by_program.loc[part.throughput_pred.idxmax()] / by_program.max())


def summarise(table: pd.DataFrame) -> dict:
    """The figures of merit: errors, bubble error, rank correlation, regret of choosing by
    prediction (the best-predicted plan's measured throughput against the best measured,
    plans that run one program judged as one: :func:`chosen_regret`)."""
    err = table["error_pct"].abs()
    out = {"plans": len(table), "median_abs_error_pct": float(err.median()),
           "max_abs_error_pct": float(err.max()),
           "median_abs_bubble_error": float((table.bubble_pred - table.bubble_meas).abs().median()),
           "spearman_throughput": float(table.throughput_pred.rank().corr(
               table.throughput_meas.rank()))}
    mem = table.dropna(subset=["peak_meas_bytes"])
    mem = mem[mem.peak_meas_bytes > 0]
    if not mem.empty:
        out["median_abs_memory_error_pct"] = float(
            (100 * (mem.peak_pred_bytes / mem.peak_meas_bytes - 1)).abs().median())
    # regret: what the best-predicted plan really achieves against the best measured
    regrets = [chosen_regret(part) for _, part in table.groupby("model")]
    out["tuner_regret_pct"] = float(100 * np.max(regrets))
    if "alone_costs_ms" in table:
        alone = (100 * (table["alone_costs_ms"] / table["measured_ms"] - 1)).abs()
        out["alone_costs_median_abs_error_pct"] = float(alone.median())
        out["alone_costs_max_abs_error_pct"] = float(alone.max())
    floor = noise_floor(table)
    if floor is not None:
        out["noise_floor_median_pct"], out["noise_floor_max_pct"] = floor
    out.update(summarise_two_passes(table))
    out.update(ablation_errors(table))
    return out


def summarise_two_passes(table: pd.DataFrame) -> dict[str, dict[str, float]]:
    """``two_passes``: median and max |error| (%) of the predictions against what the
    grid's first two passes alone measured (``measured_ms_two_passes``,
    :func:`first_passes_ms`); empty for a grid of two passes or fewer."""
    two = table.get("measured_ms_two_passes")
    if two is None or two.isna().all():
        return {}
    err = (100 * (table["predicted_ms"] / two - 1)).abs()
    return {"two_passes": {"median_abs_error_pct": float(err.median()),
                           "max_abs_error_pct": float(err.max())}}


def ablation_errors(table: pd.DataFrame) -> dict[str, dict[str, float]]:
    """``ablation_NAME``: median and max |error| (%) of each ``predicted_ms_NAME`` column
    (the same runs predicted with one mechanism out, :func:`predict_and_measure`)."""
    out = {}
    for col in [c for c in table.columns if c.startswith("predicted_ms_")]:
        err = (100 * (table[col] / table.measured_ms - 1)).abs()
        out[f"ablation_{col[len('predicted_ms_'):]}"] = {
            "median_abs_error_pct": float(err.median()), "max_abs_error_pct": float(err.max())}
    return out


def bracketed(cluster: Cluster, contention: Sequence[float],
              gaps: Sequence[Sequence[float | None]],
              in_action: Sequence[float] = ()) -> Cluster:
    """``cluster`` with the medians of the readings given (of the two around a model's
    grid, their mean; :func:`saved_grid`'s ``readings``): its host contention, its gaps
    (``(action_gap_s, wakeup_gap_s, one for all, executor_gap_base_s, wakeup_curve)`` per
    reading, the last two from 2026-11-26 on; a reading without a wake-up gap leaves one
    gap for both) and, where given, its in-action overhead (``compute_overhead_s``)."""
    median = statistics.median
    wakeups = [g[1] for g in gaps]
    overhead = median(in_action) if in_action else cluster.compute_overhead_s
    # the executor's part of those gaps, where every reading has it (from 2026-11-26)
    bases = [float(g[3]) for g in gaps if len(g) > 3 and g[3] is not None]
    # and the wake-up's growth with the wait before it, point by point (from 2026-11-26)
    curves = [tuple((float(i), float(v)) for i, v in g[4]) for g in gaps if len(g) > 4 and g[4]]
    curve = cluster.wakeup_curve
    if curves and len(curves) == len(gaps) and len({tuple(i for i, _ in c) for c in curves}) == 1:
        curve = tuple((i, median(c[k][1] for c in curves))
                      for k, (i, _) in enumerate(curves[0]))
    return dataclasses.replace(
        cluster, host_contention=median(contention),
        compute_overhead_s=overhead,
        action_gap_s=median(float(g[0] or 0.0) for g in gaps),
        wakeup_gap_s=(None if any(w is None for w in wakeups)
                      else median(float(w or 0.0) for w in wakeups)),
        executor_gap_base_s=(median(bases) if bases and len(bases) == len(gaps)
                             else cluster.executor_gap_base_s),
        wakeup_curve=curve)


def predict_saved(folder: Path, tag: str = "cpu",
                  cluster_fields: dict[str, float | None] | None = None,
                  slowdowns: dict[str, list] | None = None,
                  costs: dict[str, list] | None = None,
                  idle: dict[str, list] | None = None,
                  extras: dict[str, list] | None = None,
                  gaps: dict[str, list] | None = None,
                  gap_base_s: float | None = None,
                  contention_scale: float = 1.0, readings: str = "bracketed",
                  run_on: dict[str, list] | None = None) -> pd.DataFrame:
    """The saved grid ``folder/validation_TAG.csv`` with ``predicted_ms_now``: each plan
    predicted again by today's model from the run's own saved profiles
    (``profile_TAG_MODEL.csv``), calibration (``calibration_TAG.json``) and host-contention
    readings (``validation_TAG.json``: each model with the mean of the readings before and
    after its grid, in the grid's model order, as the run predicted it; the gaps and the
    in-action overhead likewise where the run measured them around each grid,
    ``gap_readings`` and ``in_action_readings``).  ``cluster_fields``
    then replace fields of each model's cluster (a what-if: another calibration's gaps on
    the same runs); ``slowdowns`` (model -> :class:`pipesim.readings.SpanSlowdown` rows or
    their dicts) give a model's cluster host slowdowns measured in place
    (:func:`executor.in_place.stage_contention`, the larger of it and the host law
    binding; see
    :func:`in_place_readings`): by default (None) those the run measured, as today's
    ``validate.py`` predicts with them; ``{}`` none;
    ``costs`` (model -> rows of :func:`executor.in_place.stage_costs`) give each action
    the seconds its stage was measured to take in place, where they were measured (a
    lone cost, its sharing the model's: :class:`pipesim.readings.InPlaceCost`); ``idle``
    (model -> :class:`pipesim.readings.IdleCost` rows or their dicts) a model's cluster
    the actions' idle costs measured in place
    (:func:`executor.in_place.idle_costs`): by default (None) those the run measured, as
    today's ``validate.py`` predicts with them (none in runs before 2026-11-25 evening);
    ``{}`` none; ``extras`` likewise the checkpoint's extras measured in place
    (:class:`pipesim.readings.CheckpointExtra`, :func:`executor.in_place.checkpoint_extras`;
    none in runs before 2026-11-26 05:00); ``gaps`` likewise the executor's own seconds
    between actions measured in place (:class:`pipesim.readings.ExecutorGap`; none before
    2026-11-26 07:00), with ``gap_base_s`` the calibration pipeline's own figure (by
    default the run's readings; a run without them predicts without the gaps);
    ``contention_scale`` multiplies the host-contention readings of a run calibrated by
    the old protocol (``messages="ring"``, before 2026-11-29: no
    ``host_contention_ring_readings`` in its summary), a what-if: its readings as the
    calibration's protocol since would have read them (``experiments/contention_waits.py``
    measures the ratio); ``readings`` says which of the run's host-contention readings a
    model is predicted with, their median (:data:`READINGS`): the two around its grid
    (``"bracketed"``, as ``validate.py`` predicts), every one up to the one after its
    grid (``"so_far"``, its ablation ``so_far_contention``) or every one of the run
    (``"run"``); ``run_on`` (model -> :class:`pipesim.readings.RunOnCost` rows or their
    dicts) run-on costs to predict with, by default none: an ablation, whether or not
    the run measured them (``validate.py --run-on``; :func:`in_place_readings` reads a
    run's own)."""
    grid = saved_grid(folder, tag, cluster_fields, slowdowns, idle, extras, gaps, gap_base_s,
                      contention_scale, readings, run_on)
    # (each action at its stage's lone cost in place; how it shares the host stays the
    # model's: pipesim.readings.InPlaceCost)
    clusters = {m: dataclasses.replace(c, in_place_costs=in_place_costs_of(costs[m]))
                if costs and m in costs else c for m, c in grid.clusters.items()}
    now = []
    for r in grid.table.itertuples():
        now.append(1e3 * metrics(simulate(grid.profiles[r.model], grid.plan(r),
                                          clusters[r.model],
                                          track_memory=False)).iteration_time_s)
    table = grid.table.assign(predicted_ms_now=now)
    if "reference_ms" in table:  # runs that read the machine's speed beside each plan
        table["predicted_ms_now_drift_tracked"] = drift_tracked(table, "predicted_ms_now")
    return table


@dataclasses.dataclass
class SavedGrid:
    """A saved ``validate.py`` grid as today's model predicts it (:func:`saved_grid`): its
    table, each model's profile and cluster (calibration readings as :func:`saved_grid`
    reads them)."""

    table: pd.DataFrame
    profiles: dict[str, Profile]
    clusters: dict[str, Cluster]
    batch: int

    def plan(self, row) -> Plan:
        """The Plan of one row of :attr:`table`."""
        return Plan([int(b) for b in str(row.balance).split(",")], int(row.chunks), self.batch,
                    checkpoint=row.checkpoint, schedule=row.schedule,
                    virtual_stages=2 if row.schedule in V_SCHEDULES else 1)


#: which of a run's host-contention readings each model's grid is predicted with, their
#: median (:func:`predict_saved`): a reading is taken before the first grid and after each
#: one; the gaps and the in-action overhead always take the two around the grid
READINGS = ("bracketed", "so_far", "run")


def saved_grid(folder: Path, tag: str = "cpu",
               cluster_fields: dict[str, float | None] | None = None,
               slowdowns: dict[str, list] | None = None,
               idle: dict[str, list] | None = None,
               extras: dict[str, list] | None = None,
               gaps: dict[str, list] | None = None,
               gap_base_s: float | None = None,
               contention_scale: float = 1.0, readings: str = "bracketed",
               run_on: dict[str, list] | None = None) -> SavedGrid:
    """The saved grid ``folder/validation_TAG.csv`` with the profile and cluster each model
    is predicted with today; the arguments are :func:`predict_saved`'s."""
    if readings not in READINGS:
        raise ValueError(f"readings {readings!r}: one of {', '.join(READINGS)}")
    table = pd.read_csv(folder / f"validation_{tag}.csv")
    cluster = Cluster.load(folder / f"calibration_{tag}.json")
    profiles = {m: Profile.load(folder / f"profile_{tag}_{m}.csv") for m in table.model.unique()}
    # a run cut before its end wrote no summary: then the calibration's readings alone
    summary_path = folder / f"validation_{tag}.json"
    meta = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary = meta.get("summary", {})
    contention_readings = summary.get("host_contention_readings")
    # (a run that kept the old protocol's readings beside its own was calibrated by today's)
    scale = 1.0 if "host_contention_ring_readings" in summary else contention_scale
    gap_readings = summary.get("gap_readings")
    in_action_readings = summary.get("in_action_readings")
    # (three CPU threads runs of 2026-11-26 23:00-23:18 kept their idle costs and extras
    # under "..._in_place", before they were the default prediction)
    if idle is None:
        idle = (summary.get(IN_PLACE_KEYS["idle_costs"])
                or summary.get(f"{IN_PLACE_KEYS['idle_costs']}_in_place", {}))
    if extras is None:
        extras = (summary.get(IN_PLACE_KEYS["checkpoint_extras"])
                  or summary.get(f"{IN_PLACE_KEYS['checkpoint_extras']}_in_place", {}))
    if gaps is None:
        gaps = summary.get(IN_PLACE_KEYS["executor_gaps"], {})
    if slowdowns is None:  # (the layout's own contention: predicted with since 2026-11-30)
        slowdowns = summary.get(IN_PLACE_KEYS["slowdowns"], {})
    # (run-on costs: an ablation, never the run's prediction; see validate.py --run-on)
    run_on = run_on or {}

    def around(values: list | None, i: int, otherwise: Sequence,
               which: str = "bracketed") -> Sequence:
        """The readings model i is predicted with, where the run took them: those before
        and after its grid (``"bracketed"``), every one up to the one after it
        (``"so_far"``) or every one of the run (``"run"``)."""
        if not values or len(values) <= i + 1:
            return otherwise
        return {"bracketed": values[i:i + 2], "so_far": values[:i + 2], "run": values}[which]

    clusters: dict[str, Cluster] = {}
    for i, m in enumerate(table.model.unique()):
        clusters[m] = dataclasses.replace(
            bracketed(cluster, [scale * c for c in around(contention_readings, i,
                                                           [cluster.host_contention],
                                                           readings)],
                      around(gap_readings, i, [(cluster.action_gap_s, cluster.wakeup_gap_s)]),
                      around(in_action_readings, i, ())),
            host_slowdowns=tuple((slowdowns or {}).get(m, ())),
            idle_costs=tuple(IdleCost(**x) if isinstance(x, dict) else x
                             for x in idle.get(m, ())),
            checkpoint_extras=tuple(CheckpointExtra(**x) if isinstance(x, dict) else x
                                    for x in extras.get(m, ())),
            run_on_costs=tuple(RunOnCost(**x) if isinstance(x, dict) else x
                               for x in run_on.get(m, ())), **(cluster_fields or {}))
        base = gap_base_s if gap_base_s is not None else clusters[m].executor_gap_base_s
        if base > 0:
            clusters[m] = dataclasses.replace(
                clusters[m], executor_gap_base_s=base,
                executor_gaps=tuple(ExecutorGap(**x) if isinstance(x, dict) else x
                                    for x in gaps.get(m, ())))
    return SavedGrid(table, profiles, clusters, int(meta.get("batch", 32)))


#: what each in-place measurement is called in a run's summary (``validation_TAG.json``)
#: and in its own file: host slowdowns (experiments/in_place_contention.py), idle costs
#: (experiments/idle_costs.py)
IN_PLACE_KEYS = {"slowdowns": "in_place_slowdowns", "idle_costs": "idle_costs",
                 "checkpoint_extras": "checkpoint_extras", "executor_gaps": "executor_gaps",
                 "run_on_costs": "run_on_costs"}


def in_place_readings(folder: Path, source: str, what: str, tag: str = "cpu") -> dict[str, list]:
    """Readings measured in place, per model, for :func:`predict_saved`: ``what`` is
    ``"slowdowns"`` or ``"idle_costs"`` (:data:`IN_PLACE_KEYS`); ``source`` ``"run"``
    takes those the run in ``folder`` measured (none in runs from before it measured
    them), anything else is a JSON file of them (model -> rows)."""
    if source == "run":
        meta = json.loads((folder / f"validation_{tag}.json").read_text())
        return meta.get("summary", {}).get(IN_PLACE_KEYS[what], {})
    return json.loads(Path(source).read_text())[what]


def iterations_for(profile: Profile, plan: Plan, cluster: Cluster, least: int,
                   seconds: float) -> int:
    """Iterations to measure ``plan`` for: at least ``least``, and enough for ``seconds``
    of the run by its predicted iteration time (a short plan's single iterations are the
    noisiest: the same seconds of measurement for every plan, not the same count)."""
    predicted = metrics(simulate(profile, plan, cluster, track_memory=False)).iteration_time_s
    if not predicted > 0:
        return least
    return max(least, math.ceil(seconds / predicted))


def in_passes(measure: Measure, passes: int, disagree: float | None = None,
              between: Callable[[int], object] | None = None) -> Measure:
    """``measure`` run over the grid ``passes`` times, the order reversed every other pass,
    each plan's runs joined into one Trace (:meth:`pipesim.trace.Trace.joined`: the
    iteration time is then the median over all its iterations).  A shared machine's load
    drifts over minutes; a plan measured once, in one moment, carries that moment's speed,
    measured in two moments far apart much less of it.  ``meta["pass_iteration_s"]`` keeps
    each pass's median, whose spread is the grid's noise floor (:func:`pass_noise`).

    With ``disagree`` (a fraction), a plan whose passes' medians lie further apart than
    that gets one pass more, all such plans together once the others are done, so that
    its joined median is a majority's and not the middle of two moments::

        passes  |101 100 102|          |157 156 160|     median of the six: 129 ms,
        tie     |100  99 101|                            of the nine: 101 ms

    (on this project's VM a slow spell of a neighbour's made a plan's two passes 1.6x
    apart, 2026-11-24).  ``meta["tie_break"]`` marks the plans measured so, and
    ``meta["pass_iterations"]`` counts each pass's iterations (:func:`first_passes_ms`).

    ``between(k)``, where given, runs after pass ``k`` and before the next (not after the
    last): a reading of the machine taken between the passes, as the grid goes."""
    if passes <= 1:
        return measure

    def run(plans: list[Plan]) -> list[Trace]:
        runs: list[list[Trace]] = [[] for _ in plans]
        for k in range(passes):
            order = list(range(len(plans)))[:: -1 if k % 2 else 1]
            for i, trace in zip(order, measure([plans[i] for i in order]), strict=True):
                runs[i].append(trace)
            if between is not None and k < passes - 1:
                between(k)
        apart = []
        if disagree is not None:
            for i, traces in enumerate(runs):
                times = [metrics(t).iteration_time_s for t in traces]
                if min(times) > 0 and max(times) / min(times) - 1 > disagree:
                    apart.append(i)
        if apart:
            for i, trace in zip(apart, measure([plans[i] for i in apart]), strict=True):
                runs[i].append(trace)
        joined = []
        for i, traces in enumerate(runs):
            trace = Trace.joined(traces)
            each = [metrics(t) for t in traces]  # once a pass: it walks every action
            trace.meta["pass_iteration_s"] = [m.iteration_time_s for m in each]
            trace.meta["pass_iterations"] = [len(m.iteration_times_s) for m in each]
            if all("reference_s" in t.meta for t in traces):
                trace.meta["pass_reference_s"] = [t.meta["reference_s"] for t in traces]
            trace.meta["tie_break"] = i in apart
            joined.append(trace)
        return joined

    return run


def first_passes_ms(trace: Trace, passes: int = 2) -> float:
    """The iteration time (ms) a plan measured in ``passes`` passes would have had: the
    median over the iterations of its first ``passes`` passes (:func:`in_passes`), so that
    one grid run in more passes says, side by side, what the extra passes bought.  NaN
    where the trace was measured in no more passes than that (nothing to compare)."""
    counts = trace.meta.get("pass_iterations", [])
    if len(counts) <= passes:
        return math.nan
    times = metrics(trace).iteration_times_s[:sum(counts[:passes])]
    return 1e3 * float(np.median(times))


def pass_columns(trace: Trace) -> dict[str, Any]:
    """A grid row's record of its passes (:func:`in_passes`): ``measured_ms_two_passes``
    (:func:`first_passes_ms`) and ``pass_ms``, each pass's median iteration (ms) in the
    order they ran, ``;``-separated (empty for a plan measured once)."""
    return {"measured_ms_two_passes": first_passes_ms(trace),
            "pass_ms": ";".join(f"{1e3 * s:.4f}" for s in trace.meta.get("pass_iteration_s", []))}


def profile_drift(before: Profile, after: Profile) -> float:
    """How much slower (%) the machine ran a model's layers after its grid than before:
    the median over sizes of the summed forward+backward seconds, after / before - 1."""
    def total(p: Profile) -> pd.Series:
        return p.table.groupby("micro_batch")[["fwd_s", "bwd_s"]].sum().sum(axis=1)

    return float(100 * ((total(after) / total(before)).median() - 1))


def pass_noise(traces: list[Trace]) -> tuple[float, float] | None:
    """Median and max |difference| (%) between a plan's first two passes (:func:`in_passes`),
    over the plans: the same plan measured twice, minutes apart.  None for one pass."""
    pairs = [t.meta["pass_iteration_s"][:2] for t in traces
             if len(t.meta.get("pass_iteration_s", [])) >= 2]
    if not pairs:
        return None
    diff = np.abs(100 * (np.array([b / a for a, b in pairs]) - 1))
    return float(np.median(diff)), float(np.max(diff))


def per_model_figures(table: pd.DataFrame, traces: list[Trace]) -> dict[str, float]:
    """One model's grid: median and max |error| (%), and its pass noise (:func:`pass_noise`),
    the floor under which its error cannot be told from the machine's drift."""
    err = table["error_pct"].abs()
    out = {"plans": len(table), "median_abs_error_pct": float(err.median()),
           "max_abs_error_pct": float(err.max())}
    if "alone_costs_ms" in table:  # with the run's own costs alone: the sharing's error
        alone = (100 * (table["alone_costs_ms"] / table["measured_ms"] - 1)).abs()
        out["alone_costs_median_abs_error_pct"] = float(alone.median())
    if "two_passes" in (whole := summarise_two_passes(table)):
        out["two_passes_median_abs_error_pct"] = whole["two_passes"]["median_abs_error_pct"]
    noise = pass_noise(traces)
    if noise is not None:
        out["pass_noise_median_pct"], out["pass_noise_max_pct"] = noise
    return out


def confirm_choice(table: pd.DataFrame, plans: list[Plan], measure: Measure,
                   rounds: int = 5) -> dict:
    """Regret of choosing by prediction, settled by measuring again.

    ``table`` holds one model's grid (rows in the order of ``plans``).  Each plan there was
    measured once, and the fastest of 60 noisy measurements is biased low, so the grid's
    regret mostly measures noise.  Here the best-predicted plan and the best-measured one
    (plans that run one program judged as one, by their mean) are re-run side by side in
    one set of processes, ``rounds`` pairs, the pair's order swapped every round (C: the
    chosen plan, B: the best measured)::

        rounds  | C B | B C | C B | B C | C B |
                  r1    r2    r3    r4    r5       r_i = 1 - B_i / C_i

    A round's two plans run one right after the other, so ``r_i`` holds little of the
    machine's drift over the rounds, and neither plan is always first.  The regret is the
    median ``r_i`` (negative when the chosen plan proves the faster); ``regret_low_pct`` /
    ``regret_high_pct`` are the smallest and largest: with 5 rounds that range holds the
    pair's true median 94% of the time (1 - 2 / 2**5, the sign test's order statistics),
    so a range across 0 is a ``tie``.  Why (``experiments/confirm_noise.py``, 2026-11-29):
    MLP's [4,4] and [1,7] at one micro-batch run the same layers one after another, and
    two grids' confirmations of them, three rounds in one order (C B C B C B) and the
    regret from the two medians, read 17.7% and 19.4% where the grids had measured the
    pick 2% and 6% the faster.  Repeated eight times beside this protocol, that one read
    +2.1..+21.4% (median +5.3%, never below 0), this one -2.9..+11.5% (median +2.1%), a
    tie every time; a pair 34% apart read 34% by both, never a tie here."""
    ids: dict = {}
    groups = [ids.setdefault(program(p), len(ids)) for p in plans]
    by_program = table.throughput_meas.groupby(groups).transform("mean").to_numpy()
    chosen = int(np.argmax(table.throughput_pred.to_numpy()))
    best = int(np.argmax(by_program))
    out = {"chosen": plans[chosen].label(), "best_measured": plans[best].label()}
    if groups[chosen] == groups[best]:
        return {**out, "regret_pct": 0.0, "rounds": 0}
    pair = [plans[chosen], plans[best]]
    order = [p for r in range(rounds) for p in (pair if r % 2 == 0 else pair[::-1])]
    times = [metrics(t).iteration_time_s for t in measure(order)]
    t_chosen = [t for p, t in zip(order, times, strict=True) if p is pair[0]]
    t_best = [t for p, t in zip(order, times, strict=True) if p is pair[1]]
    each = [100 * (1 - b / c) for b, c in zip(t_best, t_chosen, strict=True)]
    return {**out, "chosen_ms": 1e3 * statistics.median(t_chosen),
            "best_ms": 1e3 * statistics.median(t_best),
            "regret_pct": statistics.median(each), "regret_low_pct": min(each),
            "regret_high_pct": max(each), "tie": min(each) < 0 < max(each), "rounds": rounds}


def noise_floor(table: pd.DataFrame) -> tuple[float, float] | None:
    """Median and max |difference| (%) between two measurements of one schedule: at one
    micro-batch GPipe and 1F1B run the same actions in the same order, so what sets their
    measured times apart is the machine.  A prediction error under this floor cannot be
    told from noise.  None where the grid lacks such pairs."""
    one = table[table.chunks == 1]
    if not {"gpipe", "1f1b"} <= set(one.schedule):
        return None
    pairs = one.pivot_table(index=["model", "balance", "checkpoint"], columns="schedule",
                            values="measured_ms").dropna()
    if pairs.empty:
        return None
    diff = (100 * (pairs["1f1b"] / pairs["gpipe"] - 1)).abs()
    return float(diff.median()), float(diff.max())


#: the fields of a reading's row that are measured seconds (the others are its key)
SECONDS_FIELDS = ("seconds", "fwd_s", "bwd_s", "hot_s", "after_idle_s")


def mean_readings(*readings: list[Reading],
                  statistic: Callable[[list[float]], float] = statistics.fmean) -> list[Reading]:
    """Each row's seconds (:data:`SECONDS_FIELDS`) the mean (or ``statistic``, such as
    :func:`statistics.median`) of the readings that have its key (every other field: span,
    size, mode), for rows such as CheckpointExtra, ExecutorGap, InPlaceCost and IdleCost."""
    values: dict[Reading, list[Reading]] = {}
    for reading in readings:
        for x in reading:
            fields = [f.name for f in dataclasses.fields(x) if f.name in SECONDS_FIELDS]
            values.setdefault(dataclasses.replace(x, **dict.fromkeys(fields, 0.0)), []).append(x)
    return [dataclasses.replace(key, **{f: statistic([getattr(x, f) for x in rows])
                                        for f in SECONDS_FIELDS if hasattr(key, f)})
            for key, rows in sorted(values.items(), key=lambda kv: dataclasses.astuple(kv[0]))]
