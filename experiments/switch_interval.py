"""Is it the interpreter's hand-over? Stage threads under different GIL switch intervals.

Two stages as threads of one process take turns for the interpreter.  CPython hands it
over when its holder blocks or releases it, or -- when another thread has asked for it
-- once the holder has run ``sys.getswitchinterval()`` seconds (5 ms by default).  A
launch-bound thread (a GPU forward at 2 samples: a few microseconds of Python per
operation, the interpreter released inside each) keeps it from one operation to the
next, so a thread that needs it in short sections (autograd's device thread running a
checkpointed backward's recomputation and hooks) may wait up to an interval at each::

    stage 0 F   |==.==.==.==.==.==.==.==.==.==|          holds it between operations
    engine (Bc)  ~~~~~ waits 5 ms ~~~~~|=|~~~~ 5 ms ~~~~~|=|   one section an interval

On the H200 grid (2026-11-26) gpt's 2-sample plans lost more than their overlap: a
checkpointed backward 1.35 s a second beside forwards (``interference_by_kind.py``), and
in 1F1B [1,9] at 16 micro-batches (checkpointed) the iteration took 441 ms where every
action at its cost in place, one after another, takes 349 -- two threads slower than one
doing all the work.  If the hand-over is the cause, a shorter interval shortens those
waits and a longer one lengthens them; if it is not, the interval changes nothing.

Or is it the hand-over *between cores*?  Each hand-over wakes a thread on another core,
and on this project's 2-core VM a thread that waits for the other stage's action pays
for it: the small gpt's forward, two threads taking turns through an event (one waits
while the other runs), took 1.11x (median of 40 blocks) what one thread running both
stages' forwards in turn takes; 1.12x with the two threads pinned to two cores, 1.04x
with both on one core, 1.12x for one thread sleeping a forward's time between forwards
(2026-11-27, ``experiments/wait_placement.py``).
``--placements free,one_core`` also runs every plan with every thread of this process
(the stage workers, autograd's device threads, the rest) on one core, at the default
interval: if the cross-core hand-over is the loss, one core does no worse than the free
placement where the threads overlap least (the checkpointed 2-sample plans).

Each plan is run with each interval in turn (``sys.setswitchinterval``), and each further
placement at the default interval, ``--rounds`` rounds in alternating order, each for at
least ``--min-seconds``; the table gives each plan's median iteration per interval and
placement against the default interval's, free.

    python experiments/switch_interval.py [--device cuda:0] [--model gpt] [--small]
        [--intervals 0.0005,0.005,0.05] [--placements free,one_core] [--rounds 3]
Writes experiments/results/[gpu/]switch_interval.csv, a row per plan and interval.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.cores import first_cores, threads_on
from executor.models import builtin_job
from executor.pipeline import Pipeline
from experiments.common import machine, write_results
from experiments.gpu_validate import MODELS
from experiments.validate_threads import MODELS as SMALL
from pipesim.plan import Plan
from pipesim.trace import metrics

#: the H200 grid's plans under by 15-30% with their costs in place (all 16 micro-batches
#: of 2 samples, checkpointed), and two it predicts within 2-11% as controls; per model
#: the balances of gpu_validate.py's grid
PLANS = {"gpt": [("1f1b", "1,9", 16, "always"), ("1f1b", "5,5", 16, "except_last"),
                 ("gpipe", "5,5", 16, "except_last"), ("gpipe", "5,5", 16, "always"),
                 ("1f1b", "5,5", 4, "never")],
         "mlp": [("1f1b", "5,4", 16, "except_last"), ("1f1b", "1,8", 16, "always"),
                 ("gpipe", "1,8", 16, "except_last"), ("gpipe", "5,4", 16, "never"),
                 ("1f1b", "5,4", 4, "never")]}
BATCH = 32


def iteration_s(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor, iterations: int) -> float:
    """Median measured iteration (seconds) of ``iterations`` after one warm-up."""
    return metrics(pipe.run(x, y, iterations=iterations, warmup=1).trace).iteration_time_s


#: the placements of this process's threads ``--placements`` takes: where the operating
#: system puts them, or every one on this process's first core (executor.cores)
PLACEMENTS = {"free": None, "one_core": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default="gpt", choices=sorted(PLANS))
    ap.add_argument("--small", action="store_true",
                    help="validate_threads.py's small models, the same layer counts (for a CPU)")
    ap.add_argument("--intervals", default="0.0005,0.005,0.05",
                    help="switch intervals, seconds (the default one, 0.005, is the reference)")
    ap.add_argument("--placements", default="free",
                    help="placements of this process's threads, comma-separated (free, "
                    "one_core: every thread on one core); those past free run at the "
                    "default interval only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    args = ap.parse_args()
    intervals = [float(v) for v in args.intervals.split(",")]
    default = sys.getswitchinterval()
    placements = args.placements.split(",")
    unknown = sorted(set(placements) - set(PLACEMENTS))
    if unknown:
        ap.error(f"unknown placements {unknown}: choose from {', '.join(PLACEMENTS)}")
    # (interval, placement) pairs: every interval free, every other placement at the default
    variants = [(v, "free") for v in intervals] + [
        (default, p) for p in placements if p != "free"]
    if torch.device(args.device).type == "cpu":
        # one torch thread a stage, as validate_threads.py runs them (and so that one core
        # holds no idle intra-op workers spinning beside the stages)
        torch.set_num_threads(1)
    sizes = (SMALL if args.small else MODELS)[args.model]
    module, loss_fn, x, y = builtin_job(args.model, BATCH, **sizes)
    subdir = "gpu" if torch.device(args.device).type == "cuda" else ""
    rows = []
    try:
        for schedule, balance, chunks, checkpoint in PLANS[args.model]:
            plan = Plan([int(b) for b in balance.split(",")], chunks, BATCH,
                        checkpoint=checkpoint, schedule=schedule)
            with Pipeline(module, plan, devices=[args.device] * plan.n_stages,
                          loss_fn=loss_fn, track_memory=False) as pipe:
                once = iteration_s(pipe, x, y, 2)
                n = max(3, math.ceil(args.min_seconds / max(once, 1e-6)))
                times: dict[tuple[float, str], list[float]] = {v: [] for v in variants}
                for r in range(args.rounds):
                    for v, placement in variants[::-1] if r % 2 else variants:
                        sys.setswitchinterval(v)
                        with threads_on(first_cores(PLACEMENTS[placement])):
                            times[v, placement].append(iteration_s(pipe, x, y, n))
                        sys.setswitchinterval(default)
            module.zero_grad(set_to_none=True)
            reference = statistics.median(times.get((default, "free"), times[variants[0]]))
            for (v, placement), ts in times.items():
                rows.append({"model": args.model, "plan": plan.label(), "interval_s": v,
                             "placement": placement,
                             "iteration_ms": 1e3 * statistics.median(ts),
                             "rounds_ms": [round(1e3 * t, 3) for t in ts],
                             "against_default": statistics.median(ts) / reference})
            # written as it goes: a run cut short keeps its plans
            write_results("switch_interval", pd.DataFrame(rows),
                          {**machine(), "device": args.device, "model": args.model,
                           "default_interval_s": default, "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}, subdir)
            last = pd.DataFrame(rows[-len(variants):])
            print(last.assign(interval_ms=1e3 * last.interval_s)[
                ["plan", "interval_ms", "placement", "iteration_ms", "against_default"]]
                .round(3).to_string(index=False), flush=True)
    finally:
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
