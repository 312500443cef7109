"""Where a CPU grid's time goes: each action against its profile, and the gaps between them.

A grid run (``validate.py``) leaves every measured action (``validation_TAG_actions.csv.gz``)
beside the profiles and calibration it was predicted from.  This script reads them back
and splits the prediction's error into its parts, measured rather than fitted:

* **actions**: each measured compute action over the seconds the simulator gives it alone
  (its profile and in-action overhead, no host contention), per model, balance, stage
  and pass, apart for actions that ran *alone* (under 10% of their time beside the other
  rank's compute), *partly* beside it, or *overlapping* (over 90%): what the host
  contention should charge is the overlapping ratio over the alone one;
* **gaps**: the run's own waits between actions that the schedule does not explain
  (:func:`executor.calibrate.unexplained_gaps`: after an action whose input was there,
  after a wake-up on a late input), per model, balance and micro-batch count, against the
  calibrated ``action_gap_s`` and ``wakeup_gap_s``;
* with ``--gap-sizes``, the calibration's own pipeline run with larger messages
  (:func:`executor.calibrate.measure_gaps`): how the gaps grow with a message's bytes.

    python experiments/action_costs.py [--run experiments/results] [--tag cpu] [--gap-sizes]
Writes experiments/results/action_costs.csv (per plan, stage, pass and overlap class: the
ratio's median and mean), action_costs_gaps.csv and action_costs.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd

from executor.calibrate import measure_gaps, unexplained_gaps
from experiments.common import RESULTS, machine, write_results
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.simulator import Simulator

#: the calibration pipeline's (width, micro-batch) for ``--gap-sizes``: messages of
#: 16, 128 and 256 KiB (float32)
GAP_PIPELINES = ((512, 8), (512, 64), (1024, 64))


def parse_plan(label: str, batch: int) -> Plan:
    """The Plan of a label as the runs write it, ``"gpipe [4,4] m=16 ckpt=never"``."""
    schedule, balance, chunks, checkpoint = label.split()
    return Plan([int(b) for b in balance.strip("[]").split(",")], int(chunks.removeprefix("m=")),
                batch, checkpoint=checkpoint.removeprefix("ckpt="), schedule=schedule)


def overlap_class(fraction: float) -> str:
    """``alone`` (< 10% of the action beside the other rank's compute), ``partly``,
    ``overlapping`` (> 90%)."""
    return "alone" if fraction < 0.1 else "overlapping" if fraction > 0.9 else "partly"


def beside_shares(iteration: pd.DataFrame) -> list[float]:
    """Each of one iteration's compute actions (rows with ``device``, ``start``, ``end``),
    in their order: the share of its seconds beside another device's actions there."""
    spans = {d: g[["start", "end"]].to_numpy() for d, g in iteration.groupby("device")}
    out = []
    for r in iteration.itertuples():
        seconds = r.end - r.start
        beside = sum(np.clip(np.minimum(s[:, 1], r.end) - np.maximum(s[:, 0], r.start),
                             0.0, None).sum() for d, s in spans.items() if d != r.device)
        out.append(beside / seconds if seconds > 0 else 0.0)
    return out


def action_ratios(actions: pd.DataFrame, profiles: dict[str, Profile], cluster: Cluster,
                  batch: int) -> pd.DataFrame:
    """One row per measured compute action: its seconds, the simulator's seconds for it
    alone (``host_contention`` 0), and the share of it beside another rank's compute."""
    alone = dataclasses.replace(cluster, host_contention=0.0, host_slowdowns=())
    compute = actions[actions.kind.isin(["F", "B"])]
    rows = []
    for (model, label), part in compute.groupby(["model", "plan"]):
        plan = parse_plan(label, batch)
        sim = Simulator(profiles[model], plan, alone, track_memory=False)
        predicted = {(step.stage, step.kind, mb): step.seconds
                     for program in sim.programs for mb, step in program}
        for _, it in part.groupby("iteration"):
            for r, share in zip(it.itertuples(), beside_shares(it), strict=True):
                rows.append((model, ",".join(map(str, plan.balance)), plan.n_microbatches,
                             plan.checkpoint, r.stage, r.kind, r.end - r.start,
                             predicted[(r.stage, r.kind, r.microbatch)], share))
    out = pd.DataFrame(rows, columns=["model", "balance", "chunks", "checkpoint", "stage", "kind",
                                      "measured_s", "predicted_alone_s", "beside_share"])
    return out.assign(ratio=out.measured_s / out.predicted_alone_s,
                      overlap=out.beside_share.map(overlap_class))


def grid_gaps(actions: pd.DataFrame, latency_s: float, batch: int) -> pd.DataFrame:
    """The run's unexplained gaps (seconds, means) per model, balance and micro-batch count."""
    rows = []
    for (model, label), part in actions.groupby(["model", "plan"]):
        plan = parse_plan(label, batch)
        gaps = unexplained_gaps(part, latency_s)
        ready = [g for g, blocked in gaps if not blocked]
        woken = [g for g, blocked in gaps if blocked]
        rows.append({"model": model, "balance": ",".join(map(str, plan.balance)),
                     "chunks": plan.n_microbatches,
                     "ready_s": float(np.mean(ready)) if ready else np.nan,
                     "woken_s": float(np.mean(woken)) if woken else np.nan})
    return (pd.DataFrame(rows).groupby(["model", "balance", "chunks"])[["ready_s", "woken_s"]]
            .median().reset_index())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=RESULTS, help="a validate.py results folder")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--gap-sizes", action="store_true",
                    help="also run the calibration pipeline with larger messages (~1 min)")
    args = ap.parse_args()
    actions = pd.read_csv(args.run / f"validation_{args.tag}_actions.csv.gz")
    cluster = Cluster.load(args.run / f"calibration_{args.tag}.json")
    meta = json.loads((args.run / f"validation_{args.tag}.json").read_text())
    batch = int(meta.get("batch", 32))
    profiles = {m: Profile.load(args.run / f"profile_{args.tag}_{m}.csv")
                for m in actions.model.unique()}
    table = action_ratios(actions, profiles, cluster, batch)
    summary = (table.groupby(["model", "balance", "stage", "kind", "overlap"]).ratio
               .median().unstack("overlap"))
    with pd.option_context("display.width", 160):
        print("measured action / predicted alone (median), by its time beside the other rank")
        print(summary.round(3).to_string())
    gaps = grid_gaps(actions, cluster.link.latency_s, batch)
    with pd.option_context("display.width", 160):
        print(f"unexplained gaps (us, means); calibrated {cluster.action_gap_s * 1e6:.0f} ready, "
              f"{(cluster.wakeup_gap_s or cluster.action_gap_s) * 1e6:.0f} woken")
        print((gaps.set_index(["model", "balance", "chunks"]) * 1e6).unstack("chunks")
              .round(0).to_string())
    sizes = []
    if args.gap_sizes:
        for width, micro in GAP_PIPELINES:
            g = measure_gaps(latency_s=cluster.link.latency_s, pin_cores=True, width=width,
                             micro_batch=micro)
            sizes.append({"message_bytes": 4 * width * micro, **g})
            print(f"calibration pipeline, messages of {4 * width * micro >> 10} KiB: actions "
                  f"{g['action_s'] * 1e6:.0f} us, gaps {g['between_actions_s'] * 1e6:.0f} us "
                  f"ready, {g['wakeup_s'] * 1e6:.0f} us woken (means)", flush=True)
    gaps.to_csv(RESULTS / "action_costs_gaps.csv", index=False)
    groups = (table.groupby(["model", "balance", "chunks", "checkpoint", "stage", "kind",
                             "overlap"])
              .agg(actions=("ratio", "size"), ratio_median=("ratio", "median"),
                   ratio_mean=("ratio", "mean"), measured_median_s=("measured_s", "median"),
                   predicted_alone_s=("predicted_alone_s", "median")).reset_index())
    path = write_results("action_costs", groups, {
        **machine(), "run": str(args.run), "tag": args.tag,
        "calibrated_gaps_s": [cluster.action_gap_s, cluster.wakeup_gap_s],
        "ratio_medians": {" ".join(map(str, k)): v for k, v in
                          summary.stack().items()},
        "gap_sizes": sizes})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
