"""What a message costs the action it lands in: the landing calibration, repeated.

A pipeline's rank receives its next input (or gradient) while it computes: gloo's thread
reads it on the rank's core, and the action computing there ends later
(:attr:`pipesim.cluster.Cluster.landing_s`, ``landing_byte_s``).  This runs the
calibration's measurement (:func:`executor.calibrate.measure_landing`: one pinned rank
steps the calibration workload, the other's message lands mid-step or between steps,
paired round by round) ``--runs`` times, and prints per run and message size the step
with a landing less the step without, and the fitted line::

    landing   rank 0  |sig|== step =+=|..wait..|sleep   (+: the message lands)
    between   rank 0  |sig|== step ==|   ^msg  |sleep

2026-11-29, this project's 2-core VM: 44-58 us at 4 and 32 KiB, 76-101 us at 256 KiB
(three runs of 30 rounds, before this script; see ``pipesim/MODEL.md``).

    python experiments/landing.py [--runs 3] [--rounds 30] [--sizes 4096,32768,262144]
Writes experiments/results/landing.csv (one row per run and size) and .json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.calibrate import LANDING_SIZES, measure_landing
from experiments.common import machine, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--sizes", default=",".join(str(n) for n in LANDING_SIZES),
                    help="message bytes, comma-separated")
    ap.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned")
    args = ap.parse_args()
    try:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: expected bytes, comma-separated")
    rows, fits = [], []
    for run in range(args.runs):
        m = measure_landing(sizes, rounds=args.rounds, pin_cores=not args.no_pin)
        fits.append({"run": run, "landing_s": m["landing_s"],
                     "landing_byte_s": m["landing_byte_s"], "step_s": m["step_s"]})
        rows += [{"run": run, "bytes": n, "landing_less_between_s": v,
                  "fitted_s": m["landing_s"] + m["landing_byte_s"] * n}
                 for n, v in m["by_size"].items()]
        print(f"run {run}: step {m['step_s'] * 1e3:.3f} ms; "
              + ", ".join(f"{n // 1024} KiB {v * 1e6:+.1f} us" for n, v in m["by_size"].items())
              + f"; fitted {m['landing_s'] * 1e6:.1f} us + "
              f"{m['landing_byte_s'] * 1e6 * 1024:.3f} us/KiB", flush=True)
    table = pd.DataFrame(rows)
    path = write_results("landing", table, {**machine(), "rounds": args.rounds,
                                            "pinned": not args.no_pin, "fits": fits})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
