"""How a grid's idle-cost readings are best combined: median, mean, or one alone.

Since 2026-12-01 ``validate.py`` reads each balance's idle costs ``--idle-repeats`` times
(3) and predicts with the per-field median; the summary keeps every reading
(``idle_cost_readings``).  This predicts such a saved grid again
(:func:`experiments.validation.predict_saved`) with its idle costs combined each way::

    median     the run's own prediction (reproduced)
    mean       each field the mean of the readings
    reading_N  the N-th reading alone (one reading per grid, as before 2026-12-01)
    none       no idle costs

    python experiments/idle_readings.py [FOLDER ...]   (default experiments/results)

Prints each variant's median / max |error| (%) and each model's median; writes
``experiments/results/idle_readings.csv`` (one row per folder and variant) and
``idle_readings.json`` (context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from experiments.common import RESULTS, machine, write_results
from experiments.validation import mean_readings, predict_saved
from pipesim.readings import IdleCost


def variants(readings: dict[str, list[list[dict]]]) -> dict[str, dict[str, list[IdleCost]]]:
    """Each way of combining a run's idle-cost readings (model -> each reading's rows):
    name -> (model -> IdleCost rows)."""
    rows = {m: [[IdleCost(**x) for x in reading] for reading in of_model]
            for m, of_model in readings.items()}
    n = min(len(of_model) for of_model in rows.values())
    out = {"median": {m: mean_readings(*r, statistic=statistics.median) for m, r in rows.items()},
           "mean": {m: mean_readings(*r) for m, r in rows.items()},
           "none": {}}
    out.update({f"reading_{i + 1}": {m: r[i] for m, r in rows.items()} for i in range(n)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, default=[RESULTS],
                    help="results folders of saved grids (validation_cpu.json)")
    args = ap.parse_args()
    table = []
    for folder in args.folders:
        summary = json.loads((folder / "validation_cpu.json").read_text())["summary"]
        readings = summary.get("idle_cost_readings")
        if not readings:
            raise SystemExit(f"{folder / 'validation_cpu.json'}: no idle_cost_readings "
                             "(a grid before 2026-12-01, or run with --no-idle-costs)")
        for name, idle in variants(readings).items():
            t = predict_saved(folder, "cpu", idle=idle)
            err = (100 * (t.predicted_ms_now / t.measured_ms - 1)).abs()
            per_model = t.assign(err=err).groupby("model").err.median()
            table.append({"folder": str(folder), "variant": name,
                          "median_abs_error_pct": err.median(), "max_abs_error_pct": err.max(),
                          **{f"{m}_pct": v for m, v in per_model.items()}})
            print(f"{folder}  {name:10s} {err.median():6.2f}% / {err.max():5.1f}%  "
                  + "  ".join(f"{m} {v:.2f}%" for m, v in per_model.items()), flush=True)
    write_results("idle_readings", pd.DataFrame(table),
                  {**machine(), "folders": [str(f) for f in args.folders]})


if __name__ == "__main__":
    main()
