"""The CPU grid's runs pooled: each plan's error over several runs, apart from the scatter.

One run of ``validate.py`` measures each plan within minutes on a shared VM whose speed
drifts by 10-20% over minutes: its errors mix the model's own bias with that drift (the
same plan's two passes differ by 6-15% median).  The drift changes from run to run; the
bias does not.  Pooled over R runs, a plan's *median* error over them keeps the bias and
loses most of the drift::

    plan (never)         7 runs of 2026-11-24, in order            pooled   scatter (sd)
    unet 1f1b [8,5] m=16 -22 -33 -25 -27 -47 -15 -18 %      -25%     15%: a bias
    gpt gpipe [3,3] m=4   +6  +8  -8 -20  +5 +15 +13 %       +6%     13%: mostly drift

Each run is a results folder as ``validate.py`` leaves it (``validation_cpu.csv/.json``,
``calibration_cpu.json``, ``profile_cpu_MODEL.csv``); ``--git N`` takes the last N runs
committed to ``experiments/results/`` from this repository's history, ``--runs`` folders.
Every prediction column the runs share is pooled (the default model as it ran, its
ablations); ``--repredict`` adds today's model (``predicted_ms_now``), each run predicted
again from its own profiles and calibration (and in-place readings, where it measured
them: idle costs, host slowdowns, ...).
Figures: per column, the pooled median and max |error| (per model too), each run's own,
the run-to-run scatter, and Spearman and the regret of each run's choice judged by the
pooled times (median over runs); and how one run's own error grows with its pass noise
(:func:`error_against_noise`: the line at zero noise is one grid's error on a quiet
machine).

    python experiments/grid_history.py [--git 4] [--runs DIR ...] [--name NAME]
                                       [--repredict [--set F=V]
                                       [--slowdowns none|FILE] [--costs FILE]
                                       [--idle none|FILE] [--extras none|FILE]
                                       [--gaps none|FILE] [--run-on run|FILE]
                                       [--contention-readings so_far|run]]
Writes experiments/results/grid_history.csv (one row per plan and column) and .json
(``grid_history_TAG`` for another ``--tag``: ``--tag threads`` pools the committed
``validate_threads.py`` runs, e.g. with ``--set thread_pairs=0`` by the shares; ``--name``
another name, for a subset pooled apart: ``--git 11 --name grid_history_echo`` pools the
runs calibrated by ``echo`` and, since every one of them also predicted with the old
protocol's readings, their ``predicted_ms_ring_contention`` beside, paired).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd

from experiments.common import write_results
from experiments.validation import (
    PLAN_COLUMNS,
    READINGS,
    in_place_readings,
    predict_saved,
    program_groups,
)
from pipesim.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
#: a plan's identity in the grid
KEY = list(PLAN_COLUMNS)
#: what one run leaves in its results folder (the prediction's inputs beside the table)
RUN_FILES = ("validation_{tag}.csv", "validation_{tag}.json", "calibration_{tag}.json")


def committed_runs(count: int, into: Path, tag: str = "cpu",
                   also: tuple[str, ...] = ()) -> list[Path]:
    """The last ``count`` runs committed to ``experiments/results/`` (the commits that
    changed ``validation_TAG.csv``), each copied out of git into a folder of ``into``,
    with the files ``also`` names (``{tag}`` filled in) where the commit has them."""
    rel = f"experiments/results/validation_{tag}.csv"
    commits = subprocess.run(["git", "-C", str(ROOT), "log", f"-{count}", "--format=%h", "--",
                              rel], check=True, capture_output=True, text=True).stdout.split()
    folders = []
    for commit in commits:
        folder = into / commit
        folder.mkdir(parents=True)
        names = [n.format(tag=tag) for n in RUN_FILES]
        for name in names:
            (folder / name).write_bytes(_git_show(commit, f"experiments/results/{name}"))
        models = pd.read_csv(folder / names[0]).model.unique()
        for name in (f"profile_{tag}_{m}.{ext}" for m in models for ext in ("csv", "json")):
            (folder / name).write_bytes(_git_show(commit, f"experiments/results/{name}"))
        for name in (n.format(tag=tag) for n in also):
            with contextlib.suppress(FileNotFoundError):  # older runs kept fewer files
                (folder / name).write_bytes(_git_show(commit, f"experiments/results/{name}"))
        folders.append(folder)
    return folders


def _git_show(commit: str, path: str) -> bytes:
    done = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"],
                          capture_output=True)
    if done.returncode != 0:
        raise FileNotFoundError(f"{path} at commit {commit}: {done.stderr.decode().strip()}")
    return done.stdout


def load_runs(folders: list[Path], tag: str = "cpu", repredict: bool = False,
              cluster_fields: dict[str, float | None] | None = None,
              slowdowns: str = "", costs: str = "", idle: str = "",
              extras: str = "", gaps: str = "", scale_contention: float = 0.0,
              contention_readings: str = "", run_on: str = "") -> pd.DataFrame:
    """One row per run and plan: measured_ms and every prediction column, ``run`` naming
    the folder (and ``predicted_ms_now`` with ``repredict``, each run's calibration with
    ``cluster_fields`` replaced, and the host slowdowns each run measured in place, where
    it did; with ``slowdowns``, ``"none"`` or a JSON file of them
    (``experiments/in_place_contention.py``): ``predicted_ms_now_no_slowdowns``, the same
    without them, or ``predicted_ms_now_slowdowns``, with the file's in their place, see
    :func:`experiments.validation.in_place_readings`; with ``costs``, a JSON file of
    stage costs measured in place (``experiments/in_place_costs.py``),
    ``predicted_ms_now_in_place_costs``: the same with each action those seconds; with
    ``idle``, ``"none"`` or a JSON file of the actions' idle costs measured in place
    (``experiments/idle_costs.py``): ``predicted_ms_now_no_idle``, the same without the
    idle costs each run measured (``predicted_ms_now`` has them), or
    ``predicted_ms_now_idle``, with the file's in their place); ``extras`` likewise for
    the checkpoint's extras measured in place (``predicted_ms_now_no_extras``, or
    ``predicted_ms_now_extras`` from a JSON file ``{"checkpoint_extras": {model: rows}}``);
    ``gaps`` likewise for the executor's own seconds between actions measured in place
    (``predicted_ms_now_no_gaps``, or ``predicted_ms_now_gaps`` from a JSON file
    ``{"executor_gaps": {model: rows}, "executor_gap_base_s": seconds}``,
    ``experiments/in_place_costs.py``); ``run_on``, ``"run"`` or a JSON file
    ``{"run_on_costs": {model: rows}}`` (:func:`executor.in_place.run_on_costs`),
    ``predicted_ms_now_run_on``: the same with run-on costs, each run's own (where it
    measured them, ``validate.py --run-on``) or the file's (runs of another hour);
    with ``scale_contention``,
    ``predicted_ms_now_scaled_contention``: the same with the host-contention readings of
    each run calibrated the old way multiplied by it, see
    :func:`experiments.validation.predict_saved`; with ``contention_readings``, one of
    :data:`experiments.validation.READINGS`, ``predicted_ms_now_<it>_contention``: the
    same with each model's host contention from those of the run's readings)."""
    measured = json.loads(Path(costs).read_text())["costs"] if repredict and costs else None
    # a file's gaps come with the calibration pipeline's figure of that hour (read once)
    gap_base = ({"gap_base_s": float(json.loads(Path(gaps).read_text())["executor_gap_base_s"])}
                if repredict and gaps not in ("", "none", "run") else {})
    tables = []
    for folder in folders:
        table = (predict_saved(folder, tag, cluster_fields) if repredict
                 else pd.read_csv(folder / f"validation_{tag}.csv"))
        if repredict and scale_contention:
            again = predict_saved(folder, tag, cluster_fields, contention_scale=scale_contention)
            table["predicted_ms_now_scaled_contention"] = again.predicted_ms_now
        if repredict and contention_readings:
            again = predict_saved(folder, tag, cluster_fields, readings=contention_readings)
            table[f"predicted_ms_now_{contention_readings}_contention"] = again.predicted_ms_now
        if measured is not None:
            again = predict_saved(folder, tag, cluster_fields, costs=measured)
            table["predicted_ms_now_in_place_costs"] = again.predicted_ms_now
        # the run's own in-place readings left out ("none") or a file's in their place
        for option, source, what in (("slowdowns", slowdowns, "slowdowns"),
                                     ("idle", idle, "idle_costs"),
                                     ("extras", extras, "checkpoint_extras"),
                                     ("gaps", gaps, "executor_gaps")):
            if repredict and source:
                readings = ({} if source == "none"
                            else in_place_readings(folder, source, what, tag))
                base = gap_base if option == "gaps" else {}
                again = predict_saved(folder, tag, cluster_fields, **{option: readings}, **base)
                table[f"predicted_ms_now_no_{option}" if source == "none"
                      else f"predicted_ms_now_{option}"] = again.predicted_ms_now
        if repredict and run_on:  # (an ablation: never in predicted_ms_now)
            again = predict_saved(folder, tag, cluster_fields,
                                  run_on=in_place_readings(folder, run_on, "run_on_costs", tag))
            table["predicted_ms_now_run_on"] = again.predicted_ms_now
        tables.append(table.assign(run=folder.name))
    return pd.concat(tables, ignore_index=True)


def in_every_run(runs: pd.DataFrame, n_runs: int) -> pd.DataFrame:
    """The rows of ``runs`` (one per run and plan) for the plans every one of the
    ``n_runs`` runs measured (a grid's plans changed with its balances over the days)."""
    counts = runs.groupby(KEY).run.nunique()
    return runs.set_index(KEY).loc[counts[counts == n_runs].index].reset_index()


def cluster_fields(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, float | None]:
    """``--set FIELD=VALUE`` items as Cluster fields (``none``: None); a bad item ends
    the program through ``ap`` with an error that names it."""
    fields: dict[str, float | None] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value or name not in Cluster.__dataclass_fields__:
            ap.error(f"--set {item!r}: expected FIELD=VALUE with a Cluster field")
        try:
            fields[name] = None if value.lower() == "none" else float(value)
        except ValueError:
            ap.error(f"--set {item!r}: {value!r} is not a number")
    return fields


def run_conditions(folders: list[Path], tag: str = "cpu") -> dict[str, dict]:
    """Per run, how steady the machine was (from ``validation_TAG.json``): its date, whether
    its ranks were pinned to their own cores (``validate.py --pin``), the
    same plan's two passes apart (median %), and each model's profile drift over its grid
    (%) -- the measurement's own quality, beside which a run's error is read."""
    out = {}
    for folder in folders:
        meta = json.loads((folder / f"validation_{tag}.json").read_text())
        summary = meta.get("summary", {})
        out[folder.name] = {"date": meta.get("date"), "pinned": bool(meta.get("pinned")),
                            "pass_noise_median_pct": summary.get("noise_floor_passes_median_pct"),
                            "profile_drift_pct": summary.get("profile_drift_pct")}
    return out


def prediction_columns(runs: pd.DataFrame) -> list[str]:
    """``predicted_ms`` and every ``predicted_ms_*`` column that no run lacks."""
    cols = [c for c in runs.columns if c == "predicted_ms" or c.startswith("predicted_ms_")]
    return [c for c in cols if runs[c].notna().all()]


def pooled(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per plan: the median over runs of ``column``'s error (%, from the log ratio, so a
    run 10% over and one 10% under pool to 0), its scatter (sd of the log ratio over runs,
    %), the runs, and the median measured and predicted times (ms)."""
    log_ratio = np.log(runs[column] / runs.measured_ms)
    per_plan = runs.assign(log_ratio=log_ratio).groupby(KEY).agg(
        log_median=("log_ratio", "median"), log_sd=("log_ratio", "std"),
        runs=("run", "nunique"), measured_ms=("measured_ms", "median"),
        predicted_ms=(column, "median"))
    per_plan["pooled_error_pct"] = 100 * np.expm1(per_plan.pop("log_median"))
    per_plan["scatter_pct"] = 100 * per_plan.pop("log_sd")
    return per_plan.reset_index().assign(column=column)


def figures(runs: pd.DataFrame, plans: pd.DataFrame, column: str) -> dict:
    """The figures of merit of one prediction column, pooled and per run."""
    err = plans.pooled_error_pct.abs()
    out: dict = {"plans": len(plans), "runs": int(runs.run.nunique()),
                 "pooled_median_abs_error_pct": float(err.median()),
                 "pooled_max_abs_error_pct": float(err.max()),
                 "scatter_median_pct": float(plans.scatter_pct.median()),
                 "spearman_throughput": float((-plans.predicted_ms).rank().corr(
                     (-plans.measured_ms).rank()))}
    out["per_model"] = {m: {"median_abs_error_pct": float(p.pooled_error_pct.abs().median()),
                            "max_abs_error_pct": float(p.pooled_error_pct.abs().max())}
                        for m, p in plans.groupby("model")}
    # regret: each run's choice (its fastest predicted plan) judged by the pooled
    # measurement, against the pooled fastest; plans that run one program (GPipe and
    # 1F1B at one micro-batch) are one plan, judged by all their measurements pooled
    group = dict(zip(map(tuple, plans[KEY].to_numpy()), program_groups(plans), strict=True))
    run_group = pd.Series([group[k] for k in map(tuple, runs[KEY].to_numpy())], index=runs.index)
    measured = runs.measured_ms.groupby(run_group).median()
    regrets: dict[str, dict[str, float]] = {}
    for m, part in runs.groupby("model"):
        best = measured.loc[run_group[part.index].unique()].min()
        per_run = [100 * (measured.loc[run_group[r[column].idxmin()]] / best - 1)
                   for _, r in part.groupby("run")]
        regrets[m] = {"median_pct": float(np.median(per_run)), "max_pct": float(np.max(per_run))}
    out["regret"] = regrets
    run_err = 100 * (runs[column] / runs.measured_ms - 1)
    out["per_run"] = {r: {"median_abs_error_pct": float(e.abs().median()),
                          "max_abs_error_pct": float(e.abs().max())}
                      for r, e in run_err.groupby(runs.run)}
    return out


def error_against_noise(per_run: dict[str, dict], conditions: dict[str, dict]) -> dict | None:
    """How a run's own median |error| grows with its pass noise (the same plan measured in
    two passes minutes apart, median %): the least-squares line ``error = at_zero_noise_pct
    + per_noise_point * noise`` over the runs that report their noise, its correlation
    ``r``, and the median error of the runs under 6% noise.  The line at zero noise is
    what one grid's error would be on a quiet machine; None with fewer than three runs."""
    pairs = [(conditions[r]["pass_noise_median_pct"], e["median_abs_error_pct"])
             for r, e in per_run.items()
             if r in conditions and conditions[r].get("pass_noise_median_pct") is not None]
    if len(pairs) < 3:
        return None
    noise, error = (np.array(v, dtype=float) for v in zip(*pairs, strict=True))
    slope, intercept = np.polyfit(noise, error, 1)
    quiet = error[noise < 6.0]
    return {"runs": len(pairs), "r": float(np.corrcoef(noise, error)[0, 1]),
            "at_zero_noise_pct": float(intercept), "per_noise_point": float(slope),
            "quiet_runs": int(quiet.size),
            "quiet_median_abs_error_pct": float(np.median(quiet)) if quiet.size else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git", type=int, default=4, help="the last N committed runs (0: none)")
    ap.add_argument("--runs", nargs="*", type=Path, default=[], help="results folders")
    ap.add_argument("--tag", default="cpu", help="the runs' tag (validation_TAG.csv)")
    ap.add_argument("--name", default="", metavar="NAME",
                    help="write experiments/results/NAME.csv/.json (default grid_history, "
                    "grid_history_TAG for another tag): a subset of the runs pooled apart, "
                    "e.g. --git 11 --name grid_history_echo")
    ap.add_argument("--repredict", action="store_true",
                    help="also today's model, each run predicted again from its own inputs")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="with --repredict: replace a field of every run's calibration "
                    "(seconds; 'none' for an unset one), e.g. --set wakeup_gap_s=0.0005")
    ap.add_argument("--slowdowns", default="", metavar="none|FILE",
                    help="with --repredict: also predict without the host slowdowns each run "
                    "measured in place ('none': predicted_ms_now_no_slowdowns), or with a "
                    "file of them (experiments/in_place_contention.py) in their place "
                    "(predicted_ms_now_slowdowns)")
    ap.add_argument("--scale-contention", type=float, default=0.0, metavar="F",
                    help="with --repredict: also predict with the host-contention readings "
                    "of the runs calibrated before 2026-11-29 (whose protocol read the wait "
                    "before a step as well) times F (predicted_ms_now_scaled_contention; a "
                    "what-if, F the ratio experiments/contention_waits.py measures)")
    ap.add_argument("--costs", default="", metavar="FILE",
                    help="with --repredict: also predict with each stage's actions timed in "
                    "place (predicted_ms_now_in_place_costs), a file of "
                    "experiments/in_place_costs.py")
    ap.add_argument("--idle", default="", metavar="none|FILE",
                    help="with --repredict: also predict without the idle costs each run "
                    "measured ('none': predicted_ms_now_no_idle), or with a file of them "
                    "(experiments/idle_costs.py) in their place (predicted_ms_now_idle)")
    ap.add_argument("--extras", default="", metavar="none|FILE",
                    help="with --repredict: also predict without the checkpoint extras each "
                    "run measured ('none': predicted_ms_now_no_extras), or with a file of "
                    "them in their place (predicted_ms_now_extras)")
    ap.add_argument("--gaps", default="", metavar="none|FILE",
                    help="with --repredict: also predict without the executor gaps each run "
                    "measured ('none': predicted_ms_now_no_gaps), or with a file of them and "
                    "their base in their place (predicted_ms_now_gaps; in_place_costs.py)")
    ap.add_argument("--run-on", default="", metavar="run|FILE",
                    help="with --repredict: also predict with run-on costs (an ablation), each "
                    "run's own ('run') or a file's (predicted_ms_now_run_on)")
    ap.add_argument("--contention-readings", default="", choices=("", *READINGS[1:]),
                    help="with --repredict: also predict with each model's host contention "
                    "the median of these of the run's readings instead of the two around "
                    "its grid (so_far: every one up to the one after its grid; run: all), "
                    "predicted_ms_now_<it>_contention")
    args = ap.parse_args()
    if (args.slowdowns or args.costs or args.idle or args.extras or args.gaps or args.run_on
            or args.scale_contention or args.contention_readings) and not args.repredict:
        ap.error("--slowdowns, --scale-contention, --costs, --idle, --extras, --gaps, "
                 "--run-on and --contention-readings need --repredict")
    if args.name and (args.name != Path(args.name).name or args.name.startswith(".")):
        ap.error(f"--name {args.name!r}: expected a file name without folders or a leading '.' "
                 "(written to experiments/results/)")
    fields = cluster_fields(ap, args.set)
    with tempfile.TemporaryDirectory() as tmp:
        folders = list(args.runs) + committed_runs(args.git, Path(tmp), args.tag)
        if not folders:
            ap.error("no runs: give --git N or --runs")
        runs = load_runs(folders, args.tag, args.repredict, fields, args.slowdowns,
                         args.costs, args.idle, args.extras, args.gaps, args.scale_contention,
                         args.contention_readings, args.run_on)
        conditions = run_conditions(folders, args.tag)
    runs = in_every_run(runs, len(folders))
    tables, summary = [], {}
    for column in prediction_columns(runs):
        plans = pooled(runs, column)
        tables.append(plans)
        summary[column] = figures(runs, plans, column)
        f = summary[column]
        print(f"{column:34s} pooled over {f['runs']} runs: median |error| "
              f"{f['pooled_median_abs_error_pct']:5.2f}%, max {f['pooled_max_abs_error_pct']:5.1f}% "
              f"(scatter {f['scatter_median_pct']:.1f}%); per run median "
              + ", ".join(f"{r['median_abs_error_pct']:.1f}" for r in f["per_run"].values()))
    table = pd.concat(tables, ignore_index=True)
    main_col = "predicted_ms_now" if args.repredict else "predicted_ms"
    worst = table[table.column == main_col].sort_values("pooled_error_pct", key=abs).tail(6)
    with pd.option_context("display.width", 160):
        print(worst.drop(columns="column").round(2).to_string(index=False))
    f = summary[main_col]
    for m, r in f["per_model"].items():
        regret = f["regret"][m]
        print(f"{main_col} {m}: pooled median |error| {r['median_abs_error_pct']:.2f}%, max "
              f"{r['max_abs_error_pct']:.1f}%; regret of each run's choice "
              f"{regret['median_pct']:.1f}% median, {regret['max_pct']:.1f}% worst")
    print(f"{main_col}: Spearman (pooled times) {f['spearman_throughput']:.3f}")
    noise_line = error_against_noise(f["per_run"], conditions)
    if noise_line is not None:
        f["error_against_noise"] = noise_line
        quiet = noise_line["quiet_median_abs_error_pct"]
        print(f"{main_col}: one run's median |error| = {noise_line['at_zero_noise_pct']:.2f}% + "
              f"{noise_line['per_noise_point']:.2f} x its pass noise (r = {noise_line['r']:.2f}, "
              f"{noise_line['runs']} runs); the {noise_line['quiet_runs']} runs under 6% noise: "
              + ("-" if quiet is None else f"{quiet:.2f}% median"))
    for name, c in conditions.items():
        drift = ", ".join(f"{m} {v:+.0f}%" for m, v in (c["profile_drift_pct"] or {}).items())
        noise = c["pass_noise_median_pct"]
        print(f"run {name} ({c['date']}{', ranks pinned' if c.get('pinned') else ''}): pass noise "
              f"{'-' if noise is None else f'{noise:.1f}%'}, profile drift {drift or '-'}")
    # (another tag's history beside the CPU processes' own: grid_history_threads, ...)
    name = args.name or ("grid_history" if args.tag == "cpu" else f"grid_history_{args.tag}")
    path = write_results(name, table, {"runs": [str(f) for f in folders],
                                       "conditions": conditions, "cluster_fields": fields,
                                       "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
