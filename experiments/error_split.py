"""One CPU grid's error, split: the measurement's scatter, the prediction's, a model's shift.

A single ``validate.py`` grid reads 3-7% median error where the same grids pooled read
under 2% (``grid_history.py``).  This says where the difference lives.  For each plan of
the committed runs, ``d = log(time in this run / the plan's median time over the runs)``,
measured and predicted alike; the shift of a model in a run is the median ``d`` of its
plans there, and what is left of ``d`` without it is the plan's own scatter::

    run r, model m:   d_meas(plan) = shift_meas(r, m) + scatter_meas(plan)
                      d_pred(plan) = shift_pred(r, m) + scatter_pred(plan)
    error(plan) = log(pred / meas) = bias(plan) + (shift_pred - shift_meas)
                                     + (scatter_pred - scatter_meas)

Printed per model and over all: the standard deviation of each part (%, of the log),
the correlation of the two scatters (0: the prediction does not follow the plan's luck in
the hour), each run's median |error| (median over runs) and that with the plan's pooled
bias and the run's shift taken out -- what one grid would read were the model exact and
the hour steady for a model's whole grid.  And what a plan's luck alone does to one
grid (``typical_*``): the error of a "prediction" that knew each plan's median time over
the runs and each model's shift in the run -- the measurement's own scatter around a
plan's typical time; per run the median and the max |scatter|, their medians over runs,
and the share of runs whose max is within 10%, the CPU target's.  Not a strict floor (a
model that follows the machine within the hour can beat it), but the size of what one
grid carries beyond any model of a plan's typical cost.

    python experiments/error_split.py [--git 16] [--repredict [--set FIELD=VALUE ...]]
Writes experiments/results/error_split.csv (one row per model and ``all``) and .json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd

from experiments.common import write_results
from experiments.grid_history import KEY, cluster_fields, committed_runs, in_every_run, load_runs


def split(runs: pd.DataFrame, column: str) -> dict[str, float]:
    """The parts of one prediction column's error over ``runs`` (one row per run and
    plan, ``measured_ms`` and ``column``): standard deviations in % of the log."""
    t = runs.assign(meas=np.log(runs.measured_ms), pred=np.log(runs[column]))
    plans = t.groupby(KEY)
    cells = [t.run, t.model]
    out: dict[str, float] = {"runs": float(t.run.nunique()), "plans": float(len(plans))}
    parts = {}
    for side in ("meas", "pred"):
        d = t[side] - plans[side].transform("median")
        shift = d.groupby(cells).transform("median")
        parts[side] = (shift, d - shift)
        out[f"shift_{side}_sd_pct"] = 100 * float(d.groupby(cells).median().std())
        out[f"scatter_{side}_sd_pct"] = 100 * float((d - shift).std())
    meas, pred = parts["meas"][1], parts["pred"][1]
    out["scatter_correlation"] = (float(np.corrcoef(meas, pred)[0, 1])
                                  if meas.std() > 0 and pred.std() > 0 else float("nan"))
    error = t.pred - t.meas
    out["shift_error_sd_pct"] = 100 * float(error.groupby(cells).median().std())
    unbiased = error - error.groupby([t[k] for k in KEY]).transform("median")
    rest = unbiased - unbiased.groupby(cells).transform("median")
    out["grid_median_abs_error_pct"] = 100 * float(
        np.expm1(error).abs().groupby(t.run).median().median())
    out["grid_median_abs_scatter_pct"] = 100 * float(
        np.expm1(rest).abs().groupby(t.run).median().median())
    # a reference for one grid's figures: a "prediction" that knew each plan's median
    # time over the runs and each model's shift in this run errs by the measurement's
    # own scatter, plan by plan (not a strict floor: a model that follows the machine
    # within the hour, or a plan's own conditions, can beat it)
    luck = np.expm1(parts["meas"][1]).abs().groupby(t.run)
    per_run_max = 100 * luck.max()
    out["typical_grid_median_abs_error_pct"] = 100 * float(luck.median().median())
    out["typical_grid_max_abs_error_pct"] = float(per_run_max.median())
    out["typical_runs_max_within_10_pct"] = 100 * float((per_run_max <= 10.0).mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git", type=int, default=16, help="the last N committed runs")
    ap.add_argument("--repredict", action="store_true",
                    help="split today's model's error (each run predicted again)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="with --repredict: a Cluster field replaced in every run (a what-if)")
    args = ap.parse_args()
    fields = cluster_fields(ap, args.set)
    if fields and not args.repredict:
        ap.error("--set needs --repredict")
    with tempfile.TemporaryDirectory() as tmp:
        folders = committed_runs(args.git, Path(tmp))
        runs = load_runs(folders, repredict=args.repredict, cluster_fields=fields or None)
    column = "predicted_ms_now" if args.repredict else "predicted_ms"
    runs = in_every_run(runs, len(folders))
    rows = [{"model": "all", **split(runs, column)}]
    rows += [{"model": m, **split(part, column)} for m, part in runs.groupby("model")]
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200):
        print(table.round(3).to_string(index=False))
    path = write_results("error_split", table, {"git": args.git, "column": column,
                                                "cluster_fields": fields})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
