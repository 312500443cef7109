"""Where a CPU grid's time goes: each action against its profile, and the gaps between them.

A grid run (``validate.py``) leaves every measured action (``validation_TAG_actions.csv.gz``)
beside the profiles and calibration it was predicted from.  This script reads them back
and splits the prediction's error into its parts, measured rather than fitted:

* **actions**: each measured compute action over the seconds the simulator gives it alone
  (its profile and in-action overhead, no host contention), per model, balance, stage
  and pass, apart for actions that ran *alone* (under 10% of their time beside the other
  rank's compute), *partly* beside it, or *overlapping* (over 90%): what the host
  contention should charge is the overlapping ratio over the alone one;
* **gaps**: the run's own waits between actions that the schedule does not explain
  (:func:`executor.calibrate.unexplained_gaps`: after an action whose input was there,
  after a wake-up on a late input), per model, balance and micro-batch count, against the
  calibrated ``action_gap_s`` and ``wakeup_gap_s``;
* with ``--gap-sizes``, the calibration's own pipeline run with larger messages
  (:func:`executor.calibrate.measure_gaps`): how the gaps grow with a message's bytes.

    python experiments/action_costs.py [--run experiments/results] [--tag cpu] [--gap-sizes]
    python experiments/action_costs.py --git 12    # the last 12 committed grids pooled
    python experiments/action_costs.py --pool experiments/results/gpu --tag cpu_4stages
Writes experiments/results/action_costs.csv (per plan, stage, pass and overlap class: the
ratio's median and mean), action_costs_gaps.csv and action_costs.json; with ``--git N``
action_costs_pooled.csv/.json (per model, idle bin and overlap class; and per run the
host contention an action meets in the pipeline against the calibrated one) and
action_costs_laws.csv/.json (each plan's compute seconds and iteration, measured and
predicted under each host law: :func:`busy_by_law`); with ``--pool DIR ... --tag TAG``
the same for saved runs, ``_TAG`` after the names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd

from executor.calibrate import measure_gaps, unexplained_gaps
from experiments.common import RESULTS, machine, write_results
from experiments.grid_history import committed_runs
from experiments.validation import saved_grid
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.simulator import Simulator, simulate
from pipesim.trace import Trace, metrics

#: the calibration pipeline's (width, micro-batch) for ``--gap-sizes``: messages of
#: 16, 128 and 256 KiB (float32)
GAP_PIPELINES = ((512, 8), (512, 64), (1024, 64))


def parse_plan(label: str, batch: int) -> Plan:
    """The Plan of a label as the runs write it, ``"gpipe [4,4] m=16 ckpt=never"``."""
    schedule, balance, chunks, checkpoint = label.split()
    return Plan([int(b) for b in balance.strip("[]").split(",")], int(chunks.removeprefix("m=")),
                batch, checkpoint=checkpoint.removeprefix("ckpt="), schedule=schedule)


def overlap_class(fraction: float) -> str:
    """``alone`` (< 10% of the action beside the other rank's compute), ``partly``,
    ``overlapping`` (> 90%)."""
    return "alone" if fraction < 0.1 else "overlapping" if fraction > 0.9 else "partly"


def beside_shares(iteration: pd.DataFrame) -> list[float]:
    """Each of one iteration's compute actions (rows with ``device``, ``start``, ``end``),
    in their order: the share of its seconds beside another device's actions there."""
    spans = {d: g[["start", "end"]].to_numpy() for d, g in iteration.groupby("device")}
    out = []
    for r in iteration.itertuples():
        seconds = r.end - r.start
        beside = sum(np.clip(np.minimum(s[:, 1], r.end) - np.maximum(s[:, 0], r.start),
                             0.0, None).sum() for d, s in spans.items() if d != r.device)
        out.append(beside / seconds if seconds > 0 else 0.0)
    return out


def idles_before(iteration: pd.DataFrame) -> list[float]:
    """Each of one iteration's compute actions, in their order: seconds since its device's
    previous compute action of the iteration ended (NaN for the device's first)."""
    ended: dict[int, float] = {}
    out = []
    for r in iteration.itertuples():
        out.append(r.start - ended[r.device] if r.device in ended else float("nan"))
        ended[r.device] = max(ended.get(r.device, r.end), r.end)
    return out


def kinds_before(iteration: pd.DataFrame) -> list[str]:
    """Each of one iteration's compute actions, in their order: what its device ran just
    before it -- ``"same"`` pass (a forward after a forward: GPipe's forward phase),
    ``"other"`` (a forward after a backward: 1F1B's steady state) or ``"first"``."""
    last: dict[int, str] = {}
    out = []
    for r in iteration.itertuples():
        out.append("first" if r.device not in last
                   else "same" if last[r.device] == r.kind else "other")
        last[r.device] = r.kind
    return out


def action_ratios(actions: pd.DataFrame, profiles: dict[str, Profile], cluster: Cluster,
                  batch: int) -> pd.DataFrame:
    """One row per measured compute action: its plan's fields, its stage, its seconds,
    the simulator's seconds for it alone (``host_contention`` 0), the share of it beside
    another rank's compute, the idle before it on its device (``idle_s``) and what that
    device ran before it (``before``: :func:`kinds_before`)."""
    alone = dataclasses.replace(cluster, host_contention=0.0, host_slowdowns=())
    compute = actions[actions.kind.isin(["F", "B"])]
    rows = []
    for (model, label), part in compute.groupby(["model", "plan"]):
        plan = parse_plan(label, batch)
        sim = Simulator(profiles[model], plan, alone, track_memory=False)
        predicted = {(step.stage, step.kind, mb): step.seconds
                     for program in sim.programs for mb, step in program}
        for _, it in part.groupby("iteration"):
            it = it.sort_values("start")
            for r, share, idle, before in zip(it.itertuples(), beside_shares(it),
                                              idles_before(it), kinds_before(it), strict=True):
                rows.append((model, ",".join(map(str, plan.balance)), plan.n_microbatches,
                             plan.checkpoint, plan.schedule, r.stage, r.kind, r.end - r.start,
                             predicted[(r.stage, r.kind, r.microbatch)], share, idle, before))
    out = pd.DataFrame(rows, columns=["model", "balance", "chunks", "checkpoint", "schedule",
                                      "stage", "kind", "measured_s", "predicted_alone_s",
                                      "beside_share", "idle_s", "before"])
    return out.assign(ratio=out.measured_s / out.predicted_alone_s,
                      overlap=out.beside_share.map(overlap_class))


#: bins of the idle before an action (ms): its input there (hot), a short wait, a long one
IDLE_BINS = ((-np.inf, 0.3, "hot <= 0.3 ms"), (0.3, 3.0, "0.3-3 ms"), (3.0, np.inf, "> 3 ms"))


def idle_bin(idle_s: float) -> str:
    """The :data:`IDLE_BINS` label of ``idle_s`` seconds (a device's first action: none)."""
    if np.isnan(idle_s):
        return "first"
    return next(label for low, high, label in IDLE_BINS if low < idle_s * 1e3 <= high)


def pooled_paces(folders: Sequence[Path], tag: str = "cpu"
                 ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame,
                            pd.DataFrame]:
    """The actions of the grid runs saved in ``folders`` (``validate.py``'s files, tagged
    ``tag``; a folder without actions is skipped), each against the seconds today's model
    gives it alone from that run's own profiles and readings
    (:func:`experiments.validation.saved_grid`, host contention 0): ``(table, contention,
    laws, repeats, late)``.

    ``table``: per model, idle bin (:func:`idle_bin`) and overlap class, the median ratio
    over every action of every run.  ``contention``: per run and model, what overlapping
    the other rank's compute cost an action whose input was there (the median, over
    stage, pass, size and checkpoint mode, of its overlapping actions' median ratio over
    its lone ones', less 1: the in-pipeline figure the host law charges), beside the
    contention the run was predicted with (the calibration's small MLP, bracketed) and the
    model's own layers in the same loop (``host_contention_model_readings``).  ``laws``:
    :func:`busy_by_law`'s rows.  ``repeats``: per run, model, stage, pass, size and mode,
    an action whose input was there after the same pass on its rank over one after the
    other pass (medians).  ``late``: :func:`late_backwards`."""
    parts, pairs, laws = [], [], []
    for folder in folders:
        path = folder / f"validation_{tag}_actions.csv.gz"
        if not path.exists():  # older runs kept no actions
            continue
        saved = saved_grid(folder, tag)
        summary_path = folder / f"validation_{tag}.json"
        summary = (json.loads(summary_path.read_text()).get("summary", {})
                   if summary_path.exists() else {})
        own = summary.get("host_contention_model_readings") or {}
        actions = pd.read_csv(path)
        for model, model_actions in actions.groupby("model", sort=False):
            t = action_ratios(model_actions, saved.profiles, saved.clusters[model], saved.batch)
            t = t.assign(run=folder.name, idle=t.idle_s.map(idle_bin))
            parts.append(t)
            hot = t[t.idle == IDLE_BINS[0][2]]
            by = (hot.groupby(["stage", "kind", "chunks", "checkpoint", "overlap"]).ratio
                  .median().unstack("overlap"))
            laws += busy_by_law(model_actions, saved.profiles[model],
                                saved.clusters[model], saved.batch,
                                own.get(model, np.nan), folder.name)
            if {"alone", "overlapping"} <= set(by.columns):
                rel = (by.overlapping / by.alone).dropna()
                pairs.append({"run": folder.name, "model": model, "groups": len(rel),
                              "in_pipeline": float(rel.median() - 1.0),
                              "predicted_with": saved.clusters[model].host_contention,
                              "own_layers": own.get(model, np.nan)})
    if not parts:
        raise SystemExit(f"action_costs.py: no validation_{tag}_actions.csv.gz in "
                         f"{', '.join(str(f) for f in folders)}")
    table = pd.concat(parts)
    paces = (table.groupby(["model", "idle", "overlap"]).ratio.agg(["median", "size"])
             .reset_index().rename(columns={"median": "ratio_median", "size": "actions"}))
    # the same stage, pass and size, its input there, after the same pass against after
    # the other: what running one pass back to back is worth (GPipe's phases)
    hot = table[(table.idle == IDLE_BINS[0][2]) & (table.before != "first")]
    by = (hot.groupby(["run", "model", "stage", "kind", "chunks", "checkpoint", "before"]).ratio
          .median().unstack("before").reindex(columns=["same", "other"]).dropna())
    repeats = (by.same / by.other).rename("same_over_other").reset_index()
    return paces, pd.DataFrame(pairs), pd.DataFrame(laws), repeats, late_backwards(table)


#: seconds after its rank's previous action beyond which a last stage's backward is late
LATE_S = 0.3e-3


def late_backwards(table: pd.DataFrame) -> pd.DataFrame:
    """The last stage's backwards after a backward (GPipe's backward phase: 1F1B's last
    stage alternates), per model and schedule at 2 or more micro-batches: the share that started
    more than :data:`LATE_S` after the rank's previous action (nothing to wait for: the
    last stage starts its backward from its own loss), and for those and the others the
    median gap before them and how much longer than alone they ran (milliseconds)."""
    last = table.balance.str.count(",")  # the last stage's index: the balance's commas
    b = table[(table.kind == "B") & (table.stage == last) & (table.before == "same")
              & (table.chunks >= 2)]
    b = b.assign(late=b.idle_s > LATE_S, gap_ms=1e3 * b.idle_s,
                 over_ms=1e3 * (b.measured_s - b.predicted_alone_s))
    out = b.groupby(["model", "schedule"]).late.agg(["size", "mean"]).rename(
        columns={"size": "backwards", "mean": "late_share"})
    for late, name in ((True, "late"), (False, "on_time")):
        part = b[b.late == late].groupby(["model", "schedule"])
        out[f"gap_ms_{name}"] = part.gap_ms.median()
        out[f"over_alone_ms_{name}"] = part.over_ms.median()
    return out.reset_index()


#: the host laws :func:`busy_by_law` predicts each plan with: the contention the run was
#: predicted with (the calibration's small MLP), the model's own layers' reading, none
LAWS = ("calibrated", "own_layers", "none")


def busy_by_law(actions: pd.DataFrame, profile: Profile, cluster: Cluster, batch: int,
                own: float, run: str) -> list[dict]:
    """Per plan of one model's grid run: its compute seconds (each device's F and B, the
    median over iterations, summed) and its iteration, measured, and predicted under each of
    :data:`LAWS`: whether a law gets the actions' seconds right, apart from the
    iteration they make (the time between actions is the rest)."""
    def figures(trace: Trace, suffix: str = "") -> dict[str, float]:
        """Its compute seconds (each device's, summed) and iteration, as :func:`metrics`
        reads them (ms)."""
        m = metrics(trace)
        return {f"busy_ms{suffix}": 1e3 * sum(m.busy_s.values()),
                f"iteration_ms{suffix}": 1e3 * m.iteration_time_s}

    rows = []
    for label, part in actions.groupby("plan"):
        plan = parse_plan(label, batch)
        row = {"run": run, "model": part.model.iloc[0], "plan": label, **figures(Trace(part))}
        for law, contention in zip(LAWS, (cluster.host_contention, own, 0.0), strict=True):
            if not np.isnan(contention):
                row |= figures(simulate(profile, plan, dataclasses.replace(
                    cluster, host_contention=contention), track_memory=False), f"_{law}")
        rows.append(row)
    return rows


def grid_gaps(actions: pd.DataFrame, latency_s: float, batch: int) -> pd.DataFrame:
    """The run's unexplained gaps (seconds, means) per model, balance and micro-batch count."""
    rows = []
    for (model, label), part in actions.groupby(["model", "plan"]):
        plan = parse_plan(label, batch)
        gaps = unexplained_gaps(part, latency_s)
        ready = [g for g, blocked in gaps if not blocked]
        woken = [g for g, blocked in gaps if blocked]
        rows.append({"model": model, "balance": ",".join(map(str, plan.balance)),
                     "chunks": plan.n_microbatches,
                     "ready_s": float(np.mean(ready)) if ready else np.nan,
                     "woken_s": float(np.mean(woken)) if woken else np.nan})
    return (pd.DataFrame(rows).groupby(["model", "balance", "chunks"])[["ready_s", "woken_s"]]
            .median().reset_index())


def pooled_report(folders: Sequence[Path], tag: str = "cpu") -> None:
    """Print and write :func:`pooled_paces` for the runs in ``folders``
    (``action_costs_pooled.*``, ``action_costs_laws.*`` and ``action_costs_late.*``, with
    ``_TAG`` after them for a tag other than ``cpu``)."""
    paces, contention, laws, repeats, late = pooled_paces(folders, tag)
    suffix = "" if tag == "cpu" else f"_{tag}"
    with pd.option_context("display.width", 160):
        print(f"measured action / predicted alone (median), {contention.run.nunique()} runs, "
              "by the idle before it and its time beside the other rank")
        print(paces.pivot_table(index=["model", "idle"], columns="overlap",
                                values="ratio_median").round(3).to_string())
        print("host contention: in the pipeline (hot actions, overlapping / alone - 1) "
              "against the calibration's and the model's own layers' (medians over runs)")
        print(contention.groupby("model")[["in_pipeline", "predicted_with", "own_layers"]]
              .median().round(3).to_string())
        print("an action whose input was there, after the same pass on its rank against after "
              "the other (medians over runs of the same stage, pass, size and mode)")
        print(repeats.groupby(["model", "kind", "chunks"]).same_over_other.median()
              .unstack("chunks").round(3).to_string())
        errors = pd.DataFrame({"model": laws.model})
        for law in (x for x in LAWS if f"busy_ms_{x}" in laws):  # (a run may lack one)
            for what in ("busy", "iteration"):
                errors[f"{what}_{law}"] = 100 * (laws[f"{what}_ms_{law}"] / laws[f"{what}_ms"] - 1)
        print("each plan's compute seconds (busy) and iteration, predicted under each host law "
              "against measured: median signed error %, per model")
        print(errors.groupby("model").median().round(1).to_string())
        print(f"the last stage's backwards after a backward: the share starting over "
              f"{LATE_S * 1e3:.1f} ms after the previous action, their gap and their seconds "
              "over alone (medians), late and on time")
        print(late.round(3).to_string(index=False))
    write_results(f"action_costs_late{suffix}", late, {**machine(), "late_s": LATE_S,
                                                       "runs": sorted(contention.run.unique())})
    write_results(f"action_costs_laws{suffix}", laws, {**machine(), "laws": list(LAWS)})
    write_results(f"action_costs_pooled{suffix}", paces, {
        **machine(), "runs": sorted(contention.run.unique()),
        "contention": contention.to_dict(orient="records"),
        "same_pass_over_other": {f"{m} {k} m={c}": float(v) for (m, k, c), v in
                                 repeats.groupby(["model", "kind", "chunks"])
                                 .same_over_other.median().items()}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=RESULTS, help="a validate.py results folder")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--gap-sizes", action="store_true",
                    help="also run the calibration pipeline with larger messages (~1 min)")
    ap.add_argument("--git", type=int, default=0, metavar="N",
                    help="pool the last N committed CPU grids instead: each action's pace "
                    "by the idle before it, its overlap and the pass its rank ran before, "
                    "the host contention in the pipeline against the calibrated one "
                    "(action_costs_pooled.csv), and each plan under three host laws "
                    "(action_costs_laws.csv); about 20 s a run")
    ap.add_argument("--pool", type=Path, nargs="+", default=[], metavar="DIR",
                    help="as --git, for the runs saved in these validate.py results folders "
                    "(with --tag: e.g. --pool experiments/results/gpu --tag cpu_4stages)")
    args = ap.parse_args()
    if args.git:
        with tempfile.TemporaryDirectory() as tmp:
            pooled_report(committed_runs(args.git, Path(tmp),
                                         also=("validation_{tag}_actions.csv.gz",)))
        return
    if args.pool:
        pooled_report(args.pool, args.tag)
        return
    actions = pd.read_csv(args.run / f"validation_{args.tag}_actions.csv.gz")
    cluster = Cluster.load(args.run / f"calibration_{args.tag}.json")
    meta = json.loads((args.run / f"validation_{args.tag}.json").read_text())
    batch = int(meta.get("batch", 32))
    profiles = {m: Profile.load(args.run / f"profile_{args.tag}_{m}.csv")
                for m in actions.model.unique()}
    table = action_ratios(actions, profiles, cluster, batch)
    summary = (table.groupby(["model", "balance", "stage", "kind", "overlap"]).ratio
               .median().unstack("overlap"))
    with pd.option_context("display.width", 160):
        print("measured action / predicted alone (median), by its time beside the other rank")
        print(summary.round(3).to_string())
    gaps = grid_gaps(actions, cluster.link.latency_s, batch)
    with pd.option_context("display.width", 160):
        print(f"unexplained gaps (us, means); calibrated {cluster.action_gap_s * 1e6:.0f} ready, "
              f"{(cluster.wakeup_gap_s or cluster.action_gap_s) * 1e6:.0f} woken")
        print((gaps.set_index(["model", "balance", "chunks"]) * 1e6).unstack("chunks")
              .round(0).to_string())
    sizes = []
    if args.gap_sizes:
        for width, micro in GAP_PIPELINES:
            g = measure_gaps(latency_s=cluster.link.latency_s, pin_cores=True, width=width,
                             micro_batch=micro)
            sizes.append({"message_bytes": 4 * width * micro, **g})
            print(f"calibration pipeline, messages of {4 * width * micro >> 10} KiB: actions "
                  f"{g['action_s'] * 1e6:.0f} us, gaps {g['between_actions_s'] * 1e6:.0f} us "
                  f"ready, {g['wakeup_s'] * 1e6:.0f} us woken (means)", flush=True)
    gaps.to_csv(RESULTS / "action_costs_gaps.csv", index=False)
    groups = (table.groupby(["model", "balance", "chunks", "checkpoint", "stage", "kind",
                             "overlap"])
              .agg(actions=("ratio", "size"), ratio_median=("ratio", "median"),
                   ratio_mean=("ratio", "mean"), measured_median_s=("measured_s", "median"),
                   predicted_alone_s=("predicted_alone_s", "median")).reset_index())
    path = write_results("action_costs", groups, {
        **machine(), "run": str(args.run), "tag": args.tag,
        "calibrated_gaps_s": [cluster.action_gap_s, cluster.wakeup_gap_s],
        "ratio_medians": {" ".join(map(str, k)): v for k, v in
                          summary.stack().items()},
        "gap_sizes": sizes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
