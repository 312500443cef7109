"""Does the tuner's choice fit its budget when it runs?  A grid of budgets, measured.

For each built-in model: a profile (transients included), then budgets from just above
the smallest peak any plan needs to above the largest; for each budget ``tune`` picks a
plan (2 devices, GPipe / 1F1B, every chunks count and checkpoint mode), the plan runs
with one process per device, and every rank's memory is measured by the tracker
(:mod:`executor.memtrack`).  A plan measured over its budget is a broken promise.

    python experiments/tune_budgets.py [--models mlp,gpt,unet] [--budgets 6]
Writes experiments/results/tune_budgets.csv: budget, chosen plan, predicted and measured
peak per device, and whether the measurement fits.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd
import torch

from executor.distributed import spawn_plans
from executor.models import builtin_job
from executor.profiler import profile
from experiments.common import machine, write_results
from experiments.validate import BATCH, MODELS
from pipesim.cluster import Cluster
from pipesim.tune import tune
from pipesim.units import format_bytes

DEVICES = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--budgets", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cluster = Cluster.cpu_processes(DEVICES)
    rows = []
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        module, loss_fn, x, y = job()
        sizes = sorted({BATCH // c for c in (1, 2, 4, 8, 16)})
        prof = profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=2, warmup=1,
                       progress=False, meta={"model": name})
        everything = tune(prof, DEVICES, BATCH, float("inf"), cluster=cluster).table
        lo, hi = float(everything.peak_bytes.min()), float(everything.peak_bytes.max())
        # from just above the smallest peak with the tuner's default margin (10%) on it
        budgets = np.geomspace(lo * 1.12, hi * 1.12, args.budgets)
        plans = [tune(prof, DEVICES, BATCH, b, cluster=cluster).best for b in budgets]
        runs = spawn_plans(job, plans, iterations=1, warmup=1, track_memory=True)
        for budget, plan, (result, _) in zip(budgets, plans, runs, strict=True):
            measured = result.trace.meta["peak_memory"]
            predicted = tune(prof, DEVICES, BATCH, budget, cluster=cluster).table
            row_pred = predicted[predicted.plan == plan].iloc[0]
            worst = max(measured.values())
            rows.append({"model": name, "budget_bytes": budget, "plan": plan.label(),
                         "predicted_peak_bytes": row_pred.peak_bytes,
                         "measured_peak_bytes": worst, "fits": worst <= budget,
                         "headroom_pct": 100 * (1 - worst / budget)})
            print(f"{name}: budget {format_bytes(budget):>10} -> {plan.label():32} predicted "
                  f"{format_bytes(row_pred.peak_bytes):>10} measured {format_bytes(worst):>10} "
                  f"{'fits' if worst <= budget else 'OVER BUDGET'}", flush=True)
    table = pd.DataFrame(rows)
    write_results("tune_budgets", table, {**machine(), "torch": torch.__version__,
                                          "over_budget": int((~table.fits).sum())})
    print(f"{int(table.fits.sum())} of {len(table)} chosen plans fit their budget when run")


if __name__ == "__main__":
    main()
