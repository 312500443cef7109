"""Where in its iteration a plan's prediction falls short, phase by phase, over the grids.

A plan's error pooled over the committed CPU grids says how much; this says where.  Each
committed grid is predicted again (today's model, the run's own profile and readings:
:func:`experiments.error_decomposition.cpu_grid`), and per iteration, measured (median
over its measured iterations) and predicted, it reads (ms from the iteration's start)::

    first stage  |F|F|F|F|      ...          |B|  |B|  |B|  |B|
    last stage      |F| |F| |F| |F||B| |B| |B| |B|        .     (GPipe drawn; any schedule)
                  first_forwards ^  ^ last_forwards      ^ last_backwards  ^ end

and, for each stage, its forwards' and backwards' busy seconds and the waits before its
actions split three ways: its input not yet sent (the sender still computing), sent but
not yet received (``transit``: from the later of the post and the worker's readiness to
the receipt), and the receipt to the action's start (``after``: the wake-up, the
executor's gap).  Summed over each iteration, medians over iterations, then over runs.

Seen over the 43 grids of 2026-11-24..27 (medians of each run's predicted less measured):
U-Net GPipe [8,5] at 16 micro-batches `never` (-10.3% pooled, the largest; 1F1B's same plan
-0.7%) ends 10.0 ms early: 2.9 ms of it by the end of the last stage's forwards, 5.6 by the
end of its backwards, the rest in the first stage's tail.  Its actions are not what is
short (every busy figure is predicted 0.4-3.7 ms over).  Its waits are: in every plan read
(U-Net and GPT [3,3] at 16, both schedules) the model puts too little in the transit
(measured 2.5-5.8 ms an iteration a stage, predicted 0-1.3) and too much after the receipt
(0.6-1.6 against 2.9-4.0: the calibrated wake-up, which holds the transit of the
calibration pipeline's small messages); their sum is right for GPT's 32 KiB messages (3.5
against 3.2 ms, last stage, GPipe) and short for U-Net's two of 128 KiB a step (7.4 against
4.2 ms GPipe, 5.8 against 4.4 1F1B), and the first stage's inputs come late by what its
sender lost (GPipe: 12.4 ms unsent against 4.9).

    python experiments/phase_errors.py [--git 43] [--plans "unet:gpipe [8,5] m=16 ckpt=never;..."]
Writes experiments/results/phase_errors.csv (one row per run, plan and figure: measured,
predicted) and phase_errors_summary.csv (per plan and figure: medians over runs) and .json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from experiments.common import RESULTS, machine, write_results
from experiments.error_decomposition import ACTIONS, cpu_grid
from experiments.grid_history import committed_runs
from pipesim.simulator import simulate
from pipesim.trace import Trace

#: the pooled grid's largest errors (2026-11-27, 43 grids) and their other schedule
PLANS = ("unet:gpipe [8,5] m=16 ckpt=never", "unet:1f1b [8,5] m=16 ckpt=never",
         "gpt:gpipe [3,3] m=16 ckpt=always", "gpt:1f1b [3,3] m=16 ckpt=always")

#: the figures per iteration, in the order printed (ms)
FIGURES = ("first_forwards", "last_forwards", "last_backwards", "end",
           "busy_F_first", "busy_F_last", "busy_B_first", "busy_B_last",
           "unsent_first", "transit_first", "after_first",
           "unsent_last", "transit_last", "after_last")


def iteration_figures(actions: pd.DataFrame) -> dict[str, float]:
    """One iteration's :data:`FIGURES` (ms) from its actions (a Trace's rows: ``device``,
    ``stage``, ``microbatch``, ``kind``, ``start``, ``end``, ``resource``; the transfers
    as ``SEND_*`` rows from the post to the receipt, ``resource`` ``"devA->devB"``).
    The first stage's device is the lowest, the last stage's the highest."""
    compute = actions[actions.kind.isin(["F", "B"])]
    t0 = compute.start.min()
    first, last = compute.device.min(), compute.device.max()
    out: dict[str, float] = {}
    for name, device in (("first", first), ("last", last)):
        mine = compute[compute.device == device].sort_values("start")
        forwards, backwards = mine[mine.kind == "F"], mine[mine.kind == "B"]
        out[f"busy_F_{name}"] = 1e3 * float((forwards.end - forwards.start).sum())
        out[f"busy_B_{name}"] = 1e3 * float((backwards.end - backwards.start).sum())
        if name == "first":
            out["first_forwards"] = 1e3 * float(forwards.end.max() - t0)
        else:
            out["last_forwards"] = 1e3 * float(forwards.end.max() - t0)
            out["last_backwards"] = 1e3 * float(backwards.end.max() - t0)
        out.update({f"{part}_{name}": 1e3 * seconds
                    for part, seconds in input_waits(actions, mine, device).items()})
    out["end"] = 1e3 * float(compute.end.max() - t0)
    return out


def input_waits(actions: pd.DataFrame, mine: pd.DataFrame, device: int) -> dict[str, float]:
    """What a device's actions waited for their inputs from other devices, summed over
    its actions (seconds): ``unsent`` (ready before the input was posted), ``transit``
    (from the later of the post and its readiness to the receipt) and ``after`` (the
    receipt to the action's start).  Ready: its previous action's end (the first action
    of the iteration: ready at its start, so it adds nothing).  An action with several
    inputs (an activation and a skip) waits for the last of them."""
    sends = actions[actions.kind.str.startswith("SEND_")
                    & actions.resource.str.endswith(f"->dev{device}")]
    kinds = {"F": ("SEND_F", "SEND_S"), "B": ("SEND_B", "SEND_SB")}
    out = {"unsent": 0.0, "transit": 0.0, "after": 0.0}
    ready = None
    for r in mine.itertuples():
        inputs = sends[(sends.microbatch == r.microbatch) & sends.kind.isin(kinds[r.kind])]
        if ready is not None and not inputs.empty:
            post, receipt = float(inputs.start.max()), float(inputs.end.max())
            out["unsent"] += max(0.0, post - ready)
            out["transit"] += max(0.0, receipt - max(post, ready))
            out["after"] += max(0.0, r.start - max(receipt, ready))
        ready = r.end
    return out


def trace_figures(trace: Trace, skip_first: bool) -> dict[str, float]:
    """:func:`iteration_figures` of every iteration of ``trace``, medians over them (the
    first left out where ``skip_first``: a measured run's warm-up)."""
    rows = [iteration_figures(part) for it, part in trace.actions.groupby("iteration")
            if not (skip_first and it == 0)]
    return pd.DataFrame(rows).median().to_dict()


def run_rows(folder: Path, plans: set[tuple[str, str]], tag: str = "cpu") -> list[dict]:
    """One row per plan of ``plans`` ((model, label)) in the saved grid ``folder`` and
    figure: measured and predicted (ms)."""
    rows = []
    for _source, model, _dtype, profile, cluster, plan, measured in cpu_grid(folder, tag):
        if (model, plan.label()) not in plans:
            continue
        predicted = simulate(profile, plan, cluster, track_memory=False)
        meas, pred = trace_figures(measured, True), trace_figures(predicted, False)
        rows += [{"run": folder.name, "model": model, "plan": plan.label(), "figure": f,
                  "measured_ms": meas[f], "predicted_ms": pred[f]} for f in FIGURES]
    return rows


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per plan and figure, the medians over runs of the measured and predicted figure and
    of their difference (predicted less measured, ms)."""
    out = (table.assign(difference_ms=table.predicted_ms - table.measured_ms)
           .groupby(["model", "plan", "figure"], sort=False)
           [["measured_ms", "predicted_ms", "difference_ms"]].median().reset_index())
    out["runs"] = table.groupby(["model", "plan", "figure"], sort=False).size().to_numpy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--git", type=int, default=43, help="the last N committed grids")
    ap.add_argument("--plans", default=";".join(PLANS),
                    help="MODEL:LABEL;... (labels as the grids write them)")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    plans = {tuple(p.split(":", 1)) for p in args.plans.split(";")}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in committed_runs(args.git, Path(tmp), args.tag, also=(ACTIONS,)):
            if (folder / ACTIONS.format(tag=args.tag)).exists():
                rows += run_rows(folder, plans, args.tag)  # type: ignore[arg-type]
    table = pd.DataFrame(rows)
    summary = summarise(table)
    meta = {**machine(), "git": args.git, "plans": sorted(args.plans.split(";")),
            "runs": int(table.run.nunique()) if len(table) else 0}
    write_results("phase_errors", table, meta)
    write_results("phase_errors_summary", summary, meta)
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        print(summary.round(2).to_string(index=False))
    print(f"wrote {RESULTS / 'phase_errors.csv'}")


if __name__ == "__main__":
    main()
