"""What the host-contention calibration reads: ranks slowing each other, or the waits.

``executor.calibrate.measure_contention`` times a small model's forward+backward on each
rank alone (the others parked at a barrier) and on all ranks at once.  Until 2026-11-29
each step of the latter was followed by a message passed round a ring and an alone step
by the next step (``messages="ring"``): a "together" step came after a blocking wait for
a message, an "alone" step after another step, and the figure mixed what a busy
neighbour costs with what a wait costs the step after it (on this VM an action after a
0.3-3 ms wait runs 1.06-1.32x its hot pace, ``experiments/action_costs.py``).

This measures them apart, side by side, on two pinned ranks, each round one reading of
each protocol (:data:`executor.calibrate.MESSAGES`), seconds apart:

* ``ring`` -- the old protocol;
* ``echo`` -- a message after every step alone too, which the other rank, idle, sends
  straight back: alone and together wait alike (the calibration since 2026-11-29);
* ``none`` -- no messages at all: the neighbour's computing on hot steps.

    python experiments/contention_waits.py [--rounds 20] [--steps 10] [--iterations 200]
Writes experiments/results/contention_waits.csv (one row per round and protocol) and
.json (medians per protocol).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.calibrate import MESSAGES, measure_contention
from experiments.common import machine, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="readings of each protocol")
    ap.add_argument("--steps", type=int, default=10, help="steps a phase")
    ap.add_argument("--iterations", type=int, default=200, help="steps of each kind a reading")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for messages in MESSAGES:
            m = measure_contention(2, args.iterations, args.steps, pin_cores=True,
                                   messages=messages)
            rows.append({"round": r, "protocol": messages, "alone_ms": 1e3 * m["alone_s"],
                         "together_ms": 1e3 * m["together_s"],
                         # (signed: measure_contention floors its figure at 0)
                         "contention": m["together_s"] / m["alone_s"] - 1.0})
        print(pd.DataFrame(rows[-len(MESSAGES):]).round(4).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    medians = table.groupby("protocol").contention.median().to_dict()
    quartiles = {p: [float(q) for q in part.quantile([0.25, 0.75])]
                 for p, part in table.groupby("protocol").contention}
    write_results("contention_waits", table, {**machine(), "medians": medians,
                                               "quartiles": quartiles, "rounds": args.rounds,
                                               "steps": args.steps,
                                               "iterations": args.iterations})
    print("median contention by protocol:", {k: round(v, 4) for k, v in medians.items()})


if __name__ == "__main__":
    main()
