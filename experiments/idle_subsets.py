"""How few idle-cost readings predict as well as all of them?

``validate.py`` measures each balance's idle costs in place (``executor.in_place.idle_costs``)
at every size of the grid (2-32 samples) after four idles (0.5, 2, 5, 20 ms): on the 2-core
VM it is the longest phase of a grid (GPT 314 s of 25 minutes, 2026-11-26), and on the
16-core host it did not fit a 10-minute call beside the 4-rank grid.  Each saved reading
keeps its size's own medians (``after_idle_s``, ``hot_s``), so a committed run can be
predicted again as if it had measured only some sizes and idles: ``seconds`` recomputed as
the median over the kept sizes of ``after_idle_s - hot_s`` (what ``idle_costs`` computes),
the profile's offset read between the kept sizes (linear in log2 size, as
:meth:`pipesim.cluster.Cluster.idle_cost` reads any missing size)::

    all        sizes 2 4 8 16 32   idles 0.5 2 5 20 ms     cost 1
    a subset   sizes 2       32    idles 0.5   5 20 ms     cost 2/5 * 7/9

Each subset's cost is the share of timed steps it keeps (sizes kept / sizes, times
``kinds * idles + 1`` kept / all; the idles themselves are a small part of a step's
settling).  What is not simulated: fewer rounds, and each kept reading's own noise (the
same medians either way).

    python experiments/idle_subsets.py [--git 27]

Prints, per subset, each run's median |error| (median and worst over runs, and its change
against all readings) and the runs pooled (grid_history's figures); writes
experiments/results/idle_subsets.csv (per run and subset) and idle_subsets.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd

from experiments.common import machine, write_results
from experiments.grid_history import KEY, committed_runs, figures, pooled
from experiments.validation import IN_PLACE_KEYS, predict_saved

#: the readings every run since 2026-11-25 evening kept
ALL_SIZES = (2, 4, 8, 16, 32)
ALL_IDLES = (0.0005, 0.002, 0.005, 0.02)
KINDS = 2  # forward and backward

#: name -> (sizes kept, idles kept); None keeps them all
SUBSETS: dict[str, tuple[tuple[int, ...] | None, tuple[float, ...] | None]] = {
    "all": (None, None),
    "sizes 2,32": ((2, 32), None),
    "sizes 2,8,32": ((2, 8, 32), None),
    "sizes 8": ((8,), None),
    "idles 0.5,5,20": (None, (0.0005, 0.005, 0.02)),
    "idles 2,20": (None, (0.002, 0.02)),
    "idles 0.5,20": (None, (0.0005, 0.02)),
    "sizes 2,32 idles 0.5,5,20": ((2, 32), (0.0005, 0.005, 0.02)),
    "sizes 2,32 idles 0.5,20": ((2, 32), (0.0005, 0.02)),
    "sizes 2,8,32 idles 0.5,5,20": ((2, 8, 32), (0.0005, 0.005, 0.02)),
}


def cost_share(sizes: tuple[int, ...] | None, idles: tuple[float, ...] | None) -> float:
    """The share of ``idle_costs``' timed steps a subset keeps (its docstring's count)."""
    s = len(sizes or ALL_SIZES) / len(ALL_SIZES)
    i = (KINDS * len(idles or ALL_IDLES) + 1) / (KINDS * len(ALL_IDLES) + 1)
    return s * i


def subset_rows(rows: list[dict], sizes: tuple[int, ...] | None,
                idles: tuple[float, ...] | None) -> list[dict]:
    """The IdleCost rows (dicts) a run would have saved measuring only ``sizes`` and
    ``idles``: those rows, each ``seconds`` the median over the kept sizes of its stage's,
    kind's, mode's and idle's ``after_idle_s - hot_s``."""
    kept = [r for r in rows if (sizes is None or r["micro_batch"] in sizes)
            and (idles is None or any(np.isclose(r["idle_s"], i) for i in idles))]
    def curve(r: dict) -> tuple:  # a stage's, kind's, mode's and idle's readings
        return r["first"], r["stop"], r["kind"], r["checkpointed"], r["idle_s"]

    groups: dict[tuple, list[float]] = {}
    for r in kept:
        groups.setdefault(curve(r), []).append(r["after_idle_s"] - r["hot_s"])
    return [{**r, "seconds": statistics.median(groups[curve(r)])} for r in kept]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git", type=int, default=27,
                    help="the last N committed runs (those without idle costs are skipped)")
    args = ap.parse_args()
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in committed_runs(args.git, Path(tmp)):
            summary = json.loads((folder / "validation_cpu.json").read_text())["summary"]
            idle = summary.get(IN_PLACE_KEYS["idle_costs"], {})
            if not idle:
                continue
            for name, (sizes, idles) in SUBSETS.items():
                rows = {m: subset_rows(r, sizes, idles) for m, r in idle.items()}
                table = predict_saved(folder, "cpu", idle=rows)
                frames.append(table.assign(run=folder.name, subset=name))
            frames.append(predict_saved(folder, "cpu", idle={}).assign(run=folder.name,
                                                                        subset="none"))
    runs = pd.concat(frames, ignore_index=True)
    runs["err"] = 100 * (runs.predicted_ms_now / runs.measured_ms - 1)
    per_run = (runs.groupby(["subset", "run"]).err.agg(lambda e: e.abs().median())
               .rename("median_abs_error_pct").reset_index())
    base = per_run[per_run.subset == "all"].set_index("run").median_abs_error_pct
    per_run["change_pct_points"] = per_run.median_abs_error_pct - per_run.run.map(base)
    rows, summary = [], {}
    for name in [*SUBSETS, "none"]:
        part = runs[runs.subset == name]
        f = figures(part, pooled(part, "predicted_ms_now"), "predicted_ms_now")
        own = per_run[per_run.subset == name]
        sizes, idles = SUBSETS.get(name, ((), ()))
        row = {"subset": name, "cost_share": cost_share(sizes, idles) if name != "none" else 0.0,
               "runs": f["runs"],
               "per_run_median_pct": float(own.median_abs_error_pct.median()),
               "per_run_worst_pct": float(own.median_abs_error_pct.max()),
               "change_median_points": float(own.change_pct_points.median()),
               "change_worst_points": float(own.change_pct_points.max()),
               "pooled_median_pct": f["pooled_median_abs_error_pct"],
               "pooled_max_pct": f["pooled_max_abs_error_pct"],
               "spearman": f["spearman_throughput"],
               **{f"pooled_{m}_pct": v["median_abs_error_pct"]
                  for m, v in f["per_model"].items()}}
        rows.append(row)
        summary[name] = row
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    write_results("idle_subsets", per_run.merge(table[["subset", "cost_share"]], on="subset"),
                  {**machine(), "key": list(KEY), "subsets": summary})


if __name__ == "__main__":
    main()
