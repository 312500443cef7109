"""Host contention measured in place, for every layout of the CPU grid, repeated.

Each built-in model's stages, in each balance the committed CPU grid ran
(``experiments/results/validation_cpu.csv``), at each of its micro-batch sizes: every
rank computing its own stage alone and beside the other, pinned as the runs are (one
reading of :func:`executor.in_place.stage_contention_readings` a repeat).  ``--repeats``
readings, taken one after the other, say how far one reading is from the next on this
machine; the file keeps their median (:func:`pipesim.readings.median_slowdowns`, what
:func:`executor.in_place.stage_contention` returns and ``validate.py`` predicts with), which
``grid_history.py --repredict --slowdowns FILE`` applies to the runs pooled there in place
of each run's own (a what-if: this hour's measurement on other hours' runs)::

    python experiments/in_place_contention.py [--models mlp,gpt,unet] [--repeats 3]
    python experiments/grid_history.py --git 5 --repredict \\
        --slowdowns experiments/results/in_place_contention.json

Writes experiments/results/in_place_contention.csv (one row per model, span, size and
repeat) and .json (``slowdowns``: model -> the median rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.in_place import stage_contention_readings
from executor.models import builtin_job
from experiments.common import RESULTS, machine, write_results
from experiments.validate import BATCH, MODELS
from pipesim.readings import median_slowdowns


def layouts(grid: pd.DataFrame, model: str) -> tuple[list[list[int]], list[int]]:
    """The balances and micro-batch sizes (samples) ``model`` ran in the grid ``grid``."""
    rows = grid[grid.model == model]
    if rows.empty:
        raise ValueError(f"the grid has no plans of model {model!r}")
    balances = sorted({tuple(int(b) for b in str(v).split(",")) for v in rows.balance})
    return [list(b) for b in balances], sorted({BATCH // int(c) for c in rows.chunks})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each layout")
    ap.add_argument("--grid", type=Path, default=RESULTS / "validation_cpu.csv",
                    help="the grid whose layouts are measured")
    args = ap.parse_args()
    grid = pd.read_csv(args.grid)
    rows = []
    slowdowns: dict[str, list[dict]] = {}  # model -> the median rows
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        balances, sizes = layouts(grid, name)
        for balance in balances:
            readings = []
            for repeat in range(args.repeats):
                t0 = time.perf_counter()
                [spans] = stage_contention_readings(job, balance, sizes)
                readings.append(spans)
                rows += [{"model": name, "balance": ",".join(map(str, balance)),
                          "repeat": repeat, **dataclasses.asdict(s)} for s in spans]
                print(f"{name} {balance} #{repeat} ({time.perf_counter() - t0:.0f} s): "
                      + " ".join(f"[{s.first},{s.stop})@{s.micro_batch} {s.slowdown:.2f}"
                                 for s in spans), flush=True)
            slowdowns.setdefault(name, []).extend(
                dataclasses.asdict(s) for s in median_slowdowns(readings))
    table = pd.DataFrame(rows)
    keys = ["model", "first", "stop", "micro_batch"]
    spread = table.groupby(keys).slowdown.agg(lambda v: v.max() - v.min()).rename("spread")
    median = pd.DataFrame([{"model": m, **row} for m, part in slowdowns.items() for row in part])
    print(median.join(spread, on=keys).round(3).to_string(index=False))
    path = write_results("in_place_contention", table,
                         {**machine(), "grid": str(args.grid), "repeats": args.repeats,
                          "slowdowns": slowdowns,
                          "spread_median": float(spread.median()),
                          "spread_max": float(spread.max())})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
