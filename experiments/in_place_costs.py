"""Each stage's actions timed in the run's own code path and layout: profile, in place, grid.

The profile times layers one by one and the simulator adds them up into a stage; a grid's
own actions (``action_costs.py``) run at 0.7-2.2x that sum, the single-layer first stages'
backwards at 1.4-2.2x.  This measures, for every layout of the committed CPU grid (model,
balance, micro-batch size, checkpointed or not), each stage's forward and backward as the
pipeline runs them, the stage alone on its rank's pinned cores
(:func:`executor.in_place.stage_costs`: the executor's StageRunner, the neighbours'
tensors synthesised; no plan of the grid is run), and prints per stage:

* ``profile``: the seconds the simulator gives the action alone (profile, isolation
  correction, in-action overhead; the latest run's profile and calibration);
* ``in_place``: the median measured here;
* ``grid``: the median of the latest grid's actions that ran alone (under 10% of their
  time beside the other rank's compute; ``action_costs.csv``), where there are any;

then writes a file that ``grid_history.py --repredict --costs FILE`` applies to the runs
pooled there (each action the seconds measured here, a what-if: this hour's measurement
on other hours' runs)::

    python experiments/action_costs.py           # the latest grid's actions (action_costs.csv)
    python experiments/in_place_costs.py [--models mlp,gpt,unet] [--rounds 10]
    python experiments/grid_history.py --git 7 --repredict \\
        --costs experiments/results/in_place_costs.json

It also writes the executor's own seconds around each action (the rows' ``between_s``,
:class:`pipesim.readings.ExecutorGap`) with the calibration pipeline's figure of the same
hour, which ``grid_history.py --repredict --gaps FILE`` lends to the runs.

Writes experiments/results/in_place_costs.csv (one row per model, stage, size and mode)
and .json (``costs``: model -> the rows; ``executor_gaps``: model -> ExecutorGap rows;
``executor_gap_base_s``).
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

from executor.calibrate import calibration_executor_gap
from executor.in_place import executor_gaps_of, stage_costs
from executor.models import builtin_job
from experiments.common import RESULTS, machine, write_results
from experiments.in_place_contention import layouts
from experiments.validate import BATCH, MODELS
from pipesim.balance import stage_firsts
from pipesim.cluster import Cluster
from pipesim.costs import profile_seconds
from pipesim.profile import Profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of 20 ms phases")
    ap.add_argument("--grid", type=Path, default=RESULTS / "validation_cpu.csv",
                    help="the grid whose layouts are measured (its run's folder holds the "
                    "profiles, calibration and action_costs.csv compared against)")
    args = ap.parse_args()
    grid = pd.read_csv(args.grid)
    folder = args.grid.parent
    cluster = Cluster.load(folder / "calibration_cpu.json")
    grid_actions = (pd.read_csv(folder / "action_costs.csv")
                    if (folder / "action_costs.csv").exists() else pd.DataFrame())
    rows = []
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        profile = Profile.load(folder / f"profile_cpu_{name}.csv")
        balances, sizes = layouts(grid, name)
        for balance in balances:
            t0 = time.perf_counter()
            measured = stage_costs(job, balance, sizes, rounds=args.rounds)
            print(f"{name} {balance} ({time.perf_counter() - t0:.0f} s)", flush=True)
            stage_of = {first: s for s, first in enumerate(stage_firsts(balance))}
            # the simulator's seconds, once per size and mode (every stage at once)
            alone = {(b, ckpt): profile_seconds(profile, cluster, balance, b, ckpt)
                     for b in sizes for ckpt in (False, True)}
            for r in measured:
                stage = stage_of[r["first"]]
                predicted = alone[(r["micro_batch"], r["checkpointed"])][stage]
                rows.append({"model": name, "balance": ",".join(map(str, balance)),
                             "stage": stage, **r, "profile_fwd_s": predicted[0],
                             "profile_bwd_s": predicted[1],
                             **_grid_alone(grid_actions, name, balance, stage,
                                           BATCH // r["micro_batch"], r["checkpointed"])})
    table = pd.DataFrame(rows)
    shown = table.assign(**{
        f"{what}_{kind}_ms": 1e3 * table[f"{prefix}{kind}_s"]
        for what, prefix in (("profile", "profile_"), ("in_place", ""), ("grid", "grid_"))
        for kind in ("fwd", "bwd")})
    columns = ["model", "balance", "stage", "micro_batch", "checkpointed",
               *[f"{w}_{k}_ms" for k in ("fwd", "bwd") for w in ("profile", "in_place", "grid")]]
    with pd.option_context("display.width", 200, "display.max_rows", 400):
        print(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for kind in ("fwd", "bwd"):
        for name, part in table.groupby("model"):
            over_profile = (part[f"{kind}_s"] / part[f"profile_{kind}_s"]).median()
            have = part.dropna(subset=[f"grid_{kind}_s"])
            grid_over = ((have[f"grid_{kind}_s"] / have[f"{kind}_s"]).median()
                         if len(have) else float("nan"))
            print(f"{name} {kind}: in place / profile {over_profile:.2f} (median), "
                  f"grid alone / in place {grid_over:.2f} over {len(have)} rows")
    costs = {str(m): [{k: (bool(v) if k == "checkpointed" else v)
                       for k, v in r.items()
                       if k in ("first", "stop", "micro_batch", "checkpointed", "fwd_s", "bwd_s")}
                      for r in part.to_dict("records")]
             for m, part in table.groupby("model")}
    # the executor's own seconds around each action (pipesim.readings.ExecutorGap), and the
    # calibration pipeline's, which its gaps hold already: what grid_history --gaps lends
    base = calibration_executor_gap(pin_cores=True)
    gaps = {str(m): [dataclasses.asdict(x) for x in executor_gaps_of(part.to_dict("records"))]
            for m, part in table.groupby("model")}
    print("executor's own seconds around an action (median over stages and sizes): " + ", ".join(
        f"{m} {1e3 * part.between_s.median():.3f} ms" for m, part in table.groupby("model"))
          + f"; the calibration pipeline's {1e3 * base:.3f} ms")
    path = write_results("in_place_costs", table,
                         {**machine(), "grid": str(args.grid), "rounds": args.rounds,
                          "costs": costs, "executor_gaps": gaps, "executor_gap_base_s": base})
    print(f"wrote {path}")


def _grid_alone(actions: pd.DataFrame, model: str, balance: list[int], stage: int,
                chunks: int, checkpointed: bool) -> dict[str, float]:
    """The latest grid's median seconds of the stage's forwards and backwards that ran
    alone, over its plans at ``chunks`` micro-batches (``always`` for a checkpointed stage,
    ``never`` else)."""
    out = {"grid_fwd_s": float("nan"), "grid_bwd_s": float("nan")}
    if actions.empty:
        return out
    mode = "always" if checkpointed else "never"
    rows = actions[(actions.model == model) & (actions.balance == ",".join(map(str, balance)))
                   & (actions.stage == stage) & (actions.chunks == chunks)
                   & (actions.checkpoint == mode) & (actions.overlap == "alone")]
    for kind, key in (("F", "grid_fwd_s"), ("B", "grid_bwd_s")):
        part = rows[rows.kind == kind]
        if len(part):
            out[key] = float(part.measured_median_s.median())
    return out


if __name__ == "__main__":
    main()
