"""The tuner's confirmed regret, measured again and again: how much of it is the machine.

``validate.py`` settles the tuner's regret by re-running its pick (C) beside the fastest
plan the grid measured (B) (:func:`experiments.validation.confirm_choice`).  Two grids of
2026-11-29 read 17.7% and 19.4% there for MLP's two one-micro-batch balances, which run
the same layers one after another, where the grids' own passes measured the pick 2% and
6% the faster.  This repeats the confirmation ``--repeats`` times for such a tie and for a
pair that does differ, each time by both protocols back to back (which goes first
alternating), and prints each protocol's readings::

    fixed   | C B | C B | C B |             1 - median(B) / median(C)   (before 2026-11-29)
    paired  | C B | B C | C B | B C | C B | median of the rounds' 1 - B_i / C_i, and
                                            their range: across 0, a tie

Each repetition is one set of processes per protocol, as in ``validate.py`` (pinned
ranks, one torch thread, each plan ``--iterations`` iterations after one warm-up).

    python experiments/confirm_noise.py [--repeats 8] [--iterations 27]
Writes experiments/results/confirm_noise.csv (one row per pair, repetition and protocol)
and .json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.distributed import spawn_plans
from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.validate import BATCH, MODELS
from experiments.validation import confirm_choice
from pipesim.plan import Plan
from pipesim.trace import Trace, metrics

#: (name, chosen, best): MLP's two balances at one micro-batch (the same layers in one
#: sequence: a tie), and checkpointing at two micro-batches against not (about 40% apart)
PAIRS = (("tie", Plan([4, 4], 1, BATCH, checkpoint="never", schedule="gpipe"),
          Plan([1, 7], 1, BATCH, checkpoint="never", schedule="gpipe")),
         ("apart", Plan([4, 4], 2, BATCH, checkpoint="always", schedule="gpipe"),
          Plan([4, 4], 2, BATCH, checkpoint="never", schedule="gpipe")))


def fixed_order(measure, chosen: Plan, best: Plan, rounds: int = 3) -> dict:
    """The confirmation as it was before 2026-11-29: ``rounds`` pairs in one order, the
    regret from the two plans' medians."""
    times = [metrics(t).iteration_time_s for t in measure([chosen, best] * rounds)]
    return {"regret_pct": 100 * (1 - statistics.median(times[1::2])
                                 / statistics.median(times[0::2]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=27,
                    help="iterations a plan is measured (about 0.25 s of these plans)")
    args = ap.parse_args()
    job = functools.partial(builtin_job, "mlp", BATCH, **MODELS["mlp"])

    def measure(plans: list[Plan]) -> list[Trace]:
        return [r.trace for r, _ in spawn_plans(job, plans, iterations=args.iterations,
                                                warmup=1, pin_cores=True,
                                                threads_per_rank=1)]

    # the grid's table as confirm_choice reads it: C predicted the fastest, B measured so
    grid = pd.DataFrame({"throughput_pred": [2.0, 1.0], "throughput_meas": [1.0, 2.0]})
    rows = []
    for name, chosen, best in PAIRS:
        for k in range(args.repeats):
            for protocol in (("fixed", "paired") if k % 2 == 0 else ("paired", "fixed")):
                out = (fixed_order(measure, chosen, best) if protocol == "fixed"
                       else confirm_choice(grid, [chosen, best], measure))
                rows.append({"pair": name, "repeat": k, "protocol": protocol,
                             "regret_pct": out["regret_pct"],
                             "low_pct": out.get("regret_low_pct"),
                             "high_pct": out.get("regret_high_pct"), "tie": out.get("tie")})
                print(f"{name} {k} {protocol:6s} regret {out['regret_pct']:+6.1f}%"
                      + (f"  rounds {out['regret_low_pct']:+.1f}..{out['regret_high_pct']:+.1f}%"
                         f"{'  tie' if out['tie'] else ''}" if protocol == "paired" else ""),
                      flush=True)
    table = pd.DataFrame(rows)
    summary = table.groupby(["pair", "protocol"]).regret_pct.agg(
        median="median", sd="std", least="min", most="max",
        abs_median=lambda s: s.abs().median()).round(2)
    ties = table[table.protocol == "paired"].groupby("pair").tie.mean()
    print(summary.to_string())
    print("paired rounds read a tie:", ties.round(2).to_dict())
    path = write_results("confirm_noise", table, {**machine(), "repeats": args.repeats,
                                                  "iterations": args.iterations,
                                                  "pairs": {n: [c.label(), b.label()]
                                                            for n, c, b in PAIRS},
                                                  "summary": summary.reset_index().to_dict(
                                                      orient="records"),
                                                  "paired_ties": ties.to_dict()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
