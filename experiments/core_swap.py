"""Does a stage run slower because of its stage or because of its core?  Ranks swapped.

In the 2-process CPU grids MLP [4,4] is predicted under by 5-12% at 2-16 micro-batches,
and its first stage's busy seconds run 7-11% over their prediction where the second
stage's are within -1..+9% (experiments/README.md, session 41); the in-place contention
reads the first rank, on core 0, the slower (1.06 against 1.00).  ``validate.py`` pins
rank ``r`` to core ``r`` (:func:`executor.distributed.rank_cores`), so "the first stage"
and "core 0" have always gone together.  This measures the same plans with the ranks on
their usual cores and swapped, in alternating sets of processes::

    usual     rank 0 -> core 0, rank 1 -> core 1
    swapped   rank 0 -> core 1, rank 1 -> core 0
    round k:  usual | swapped      round k+1: swapped | usual      ...

and, per plan and layout, each stage's busy seconds an iteration (its F and B actions'
durations summed, ``stage_busy_s`` of :func:`pipesim.trace.metrics`) and the iteration.
A stage slower on core 0 whichever it is says the core; the first stage slower wherever
it runs says the stage.  Beside it, each core's pace
alone: one process times a stage's forward and backward pinned to core 0, then core 1, in
alternation (``--alone-rounds``), with the other core idle.

    python experiments/core_swap.py [--rounds 6] [--iterations 20] [--models mlp,gpt]
Writes experiments/results/core_swap.csv (one row per plan, layout, round and stage),
core_swap_alone.csv and core_swap.json (the medians).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.distributed import spawn_plans
from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.validate import BATCH, MODELS
from pipesim.plan import Plan
from pipesim.trace import metrics

#: model -> the plans measured: MLP [4,4] (the grids' largest systematic miss, under) beside
#: [1,7] (predicted well, its first stage one layer), GPT [3,3] (over in the pooled grids)
PLANS = {"mlp": (Plan([4, 4], 8, BATCH, checkpoint="never", schedule="1f1b"),
                 Plan([4, 4], 16, BATCH, checkpoint="always", schedule="gpipe"),
                 Plan([1, 7], 8, BATCH, checkpoint="never", schedule="1f1b")),
         "gpt": (Plan([3, 3], 8, BATCH, checkpoint="never", schedule="1f1b"),)}

#: the two placements: rank -> its core
LAYOUTS = {"usual": {0: {0}, 1: {1}}, "swapped": {0: {1}, 1: {0}}}

def measure(model: str, layout: str, iterations: int) -> list[dict]:
    """One set of processes in ``layout``: each plan of ``model``, its iteration and each
    stage's busy seconds, with the core that stage ran on."""
    job = functools.partial(builtin_job, model, BATCH, **MODELS[model])
    plans = list(PLANS[model])
    runs = spawn_plans(job, plans, iterations=iterations, warmup=1,
                       pin_cores=LAYOUTS[layout], threads_per_rank=1, track_memory=False)
    rows = []
    for plan, (result, _ranks) in zip(plans, runs, strict=True):
        # (each stage's F and B seconds an iteration, the median: a recomputation's R row
        # lies inside its B and is not counted again)
        m = metrics(result.trace)
        for stage in range(len(plan.balance)):
            rows.append({"model": model, "plan": plan.label(), "layout": layout,
                         "stage": stage, "core": min(LAYOUTS[layout][stage]),
                         "busy_ms": 1e3 * m.stage_busy_s.get(stage, 0.0),
                         "iteration_ms": 1e3 * m.iteration_time_s})
    return rows


def core_pace(rounds: int, repeats: int = 20) -> pd.DataFrame:
    """Seconds of MLP [4,4]'s first stage (its forward and backward at 4 samples) on each
    core alone, this process pinned to core 0 then core 1 (order alternating by round);
    the median of ``repeats`` after two warm-ups each time."""
    module, _loss, inputs, _targets = builtin_job("mlp", BATCH, **MODELS["mlp"])
    stage = torch.nn.Sequential(*list(module)[:4])
    x = inputs[:4]
    torch.set_num_threads(1)
    before = os.sched_getaffinity(0)
    rows = []
    try:
        for k in range(rounds):
            for core in ((0, 1) if k % 2 == 0 else (1, 0)):
                os.sched_setaffinity(0, {core})
                times = []
                for i in range(repeats + 2):
                    t0 = time.perf_counter()
                    stage(x).sum().backward()
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                rows.append({"round": k, "core": core, "ms": 1e3 * statistics.median(times)})
    finally:
        os.sched_setaffinity(0, before)
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--alone-rounds", type=int, default=10)
    ap.add_argument("--models", default=",".join(PLANS),
                    help="comma-separated models of PLANS to measure")
    ap.add_argument("--name", default="core_swap", help="results file name")
    args = ap.parse_args()
    models = args.models.split(",")
    if unknown := sorted(set(models) - set(PLANS)):
        sys.exit(f"--models: {unknown} not among {sorted(PLANS)}")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("core_swap.py needs two CPUs")
    alone = core_pace(args.alone_rounds)
    rows = []
    for k in range(args.rounds):
        for layout in (("usual", "swapped") if k % 2 == 0 else ("swapped", "usual")):
            for model in models:
                rows += [dict(r, round=k) for r in measure(model, layout, args.iterations)]
            print(f"round {k}: {layout} done", flush=True)
    table = pd.DataFrame(rows)
    # per plan and stage: its busy seconds on core 0 against core 1 (ratio of medians), and
    # the iteration swapped against usual
    med = table.groupby(["plan", "stage", "layout"]).busy_ms.median().unstack("layout")
    its = table.groupby(["plan", "layout"]).iteration_ms.median().unstack("layout")
    summary = {"alone_ms": alone.groupby("core").ms.median().to_dict(),
               "alone_core0_over_core1": float(alone[alone.core == 0].ms.median()
                                               / alone[alone.core == 1].ms.median()),
               "busy_ms": {f"{p} stage {s}": row.to_dict() for (p, s), row in med.iterrows()},
               "iteration_ms": {p: row.to_dict() for p, row in its.iterrows()}}
    print(alone.groupby("core").ms.describe().round(3).to_string())
    print(med.assign(usual_over_swapped=med.usual / med.swapped).round(3).to_string())
    print(its.assign(usual_over_swapped=its.usual / its.swapped).round(3).to_string())
    write_results(args.name, table, {**machine(), "args": vars(args), "summary": summary})
    write_results(f"{args.name}_alone", alone, {**machine(), "args": vars(args)})


if __name__ == "__main__":
    main()
