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

Seen over the 44 grids of 2026-11-24..27 (medians of each run's predicted less measured):
U-Net GPipe [8,5] at 16 micro-batches `never` (-11.0% pooled, the largest; 1F1B's same plan
+0.1% here) ends 10.4 ms early: 3.0 ms of it by the end of the last stage's forwards, 5.8
by the end of its backwards, the rest in the first stage's tail.  Its actions are not what
is short (every busy figure is predicted 0.3-3.5 ms over).  Its waits are: in every plan
read (U-Net and GPT [3,3] at 16, both schedules) the model puts too little in the transit
(measured 2.5-5.7 ms an iteration a stage, predicted 0-1.3) and too much after the receipt
(0.6-1.6 against 3.0-4.0: the calibrated wake-up, which holds the transit of the
calibration pipeline's small messages); the two add up right for GPT's 32 KiB messages
(3.5 against 3.2 ms, last stage, GPipe) and short for U-Net's two of 128 KiB a step (7.3
against 4.3 ms GPipe, 5.8 against 4.4 1F1B), and the first stage's inputs come late by what
their sender lost (GPipe: 12.3 ms unsent against 4.9).  Where U-Net's transits go
(``phase_errors_transits.csv``): an input whose sender had gone on to compute before it
came took 0.21-0.24 ms at the median but 0.63-0.67 on average, 15% over 1 ms (GPipe; GPT's
0.25-0.34, 3%), against 0.10-0.11 / 0.15-0.16 ms, 1.2-1.4%, where the sender had not.
GPT GPipe [3,3] at 16 `always` (+6.8%) is the other way: its actions are over-charged
(4.2-10.8 ms a stage and pass, the calibrated host contention), its waits short.

    python experiments/phase_errors.py [--git 44] [--plans "unet:gpipe [8,5] m=16 ckpt=never;..."]
Writes experiments/results/phase_errors.csv (one row per run, plan and figure: measured,
predicted), phase_errors_summary.csv (per plan and figure: medians over runs) and
phase_errors_transits.csv (per plan, receiving stage and whether the sender computed
meanwhile: the measured transits of inputs that came after their receiver was ready), and
.json beside each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from experiments.common import RESULTS, machine, write_results
from experiments.error_decomposition import ACTIONS, cpu_grid
from experiments.grid_history import committed_runs
from pipesim.simulator import simulate
from pipesim.trace import Trace

#: the pooled grid's largest errors (2026-11-27, 44 grids) and their other schedule
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


#: the transfers that bring a forward's and a backward's inputs
INPUT_KINDS = {"F": ("SEND_F", "SEND_S"), "B": ("SEND_B", "SEND_SB")}


def _inputs(actions: pd.DataFrame, mine: pd.DataFrame, device: int
            ) -> Iterator[tuple[Any, float, float, float, str]]:
    """For each of a device's actions (``mine``, in order) but its first, whose inputs
    come from another device: ``(action, post, receipt, ready, source)`` -- the last of
    its inputs' post and receipt (an activation and a skip: the later), its readiness (its
    previous action's end) and the sending device's resource name."""
    sends = actions[actions.kind.str.startswith("SEND_")
                    & actions.resource.str.endswith(f"->dev{device}")]
    ready = None
    for r in mine.itertuples():
        inputs = sends[(sends.microbatch == r.microbatch)
                       & sends.kind.isin(INPUT_KINDS[r.kind])]
        if ready is not None and not inputs.empty:
            yield (r, float(inputs.start.max()), float(inputs.end.max()), ready,
                   str(inputs.resource.iloc[0]).split("->")[0])
        ready = r.end


def input_waits(actions: pd.DataFrame, mine: pd.DataFrame, device: int) -> dict[str, float]:
    """What a device's actions waited for their inputs from other devices, summed over
    its actions (seconds): ``unsent`` (ready before the input was posted), ``transit``
    (from the later of the post and its readiness to the receipt) and ``after`` (the
    receipt to the action's start).  Ready: its previous action's end (the first action
    of the iteration: ready at its start, so it adds nothing).  An action with several
    inputs (an activation and a skip) waits for the last of them."""
    out = {"unsent": 0.0, "transit": 0.0, "after": 0.0}
    for r, post, receipt, ready, _source in _inputs(actions, mine, device):
        out["unsent"] += max(0.0, post - ready)
        out["transit"] += max(0.0, receipt - max(post, ready))
        out["after"] += max(0.0, r.start - max(receipt, ready))
    return out


def message_transits(actions: pd.DataFrame) -> pd.DataFrame:
    """The inputs of one iteration's measured actions (:func:`input_waits`' reading) that
    came after their receiver was ready: the transit (seconds, from the later of the post
    and the readiness to the receipt) and whether the sender had started its next compute
    action before the receipt (``sender_computing``: GPipe's senders go straight on to
    their next forward or backward).  One row per receiving action: ``device``, ``kind``,
    ``microbatch``, ``transit_s``, ``sender_computing``."""
    compute = actions[actions.kind.isin(["F", "B"])]
    rows = []
    for device, mine in compute.groupby("device"):
        for r, post, receipt, ready, source in _inputs(actions, mine.sort_values("start"),
                                                       int(device)):
            if receipt <= ready:
                continue
            theirs = compute[(compute.device == int(source.removeprefix("dev")))
                             & (compute.start >= post)]
            rows.append({"device": device, "kind": r.kind, "microbatch": r.microbatch,
                         "transit_s": receipt - max(post, ready),
                         "sender_computing": bool(not theirs.empty
                                                  and theirs.start.min() < receipt)})
    return pd.DataFrame(rows, columns=["device", "kind", "microbatch", "transit_s",
                                       "sender_computing"])


def trace_figures(trace: Trace, skip_first: bool) -> dict[str, float]:
    """:func:`iteration_figures` of every iteration of ``trace``, medians over them (the
    first left out where ``skip_first``: a measured run's warm-up)."""
    rows = [iteration_figures(part) for it, part in trace.actions.groupby("iteration")
            if not (skip_first and it == 0)]
    return pd.DataFrame(rows).median().to_dict()


def run_rows(folder: Path, plans: set[tuple[str, str]], tag: str = "cpu"
             ) -> tuple[list[dict], list[pd.DataFrame]]:
    """One row per plan of ``plans`` ((model, label)) in the saved grid ``folder`` and
    figure: measured and predicted (ms); and each plan's measured transits
    (:func:`message_transits`, its measured iterations)."""
    rows, transits = [], []
    for _source, model, _dtype, profile, cluster, plan, measured in cpu_grid(folder, tag):
        if (model, plan.label()) not in plans:
            continue
        predicted = simulate(profile, plan, cluster, track_memory=False)
        meas, pred = trace_figures(measured, True), trace_figures(predicted, False)
        rows += [{"run": folder.name, "model": model, "plan": plan.label(), "figure": f,
                  "measured_ms": meas[f], "predicted_ms": pred[f]} for f in FIGURES]
        transits += [message_transits(part).assign(run=folder.name, model=model,
                                                   plan=plan.label())
                     for it, part in measured.actions.groupby("iteration") if it > 0]
    return rows, transits


def transit_summary(transits: pd.DataFrame) -> pd.DataFrame:
    """Per plan, receiving device and whether the sender was computing: how many inputs
    came after their receiver was ready, their transit's median and mean (ms) and the
    share over 1 ms."""
    ms = transits.assign(transit_ms=1e3 * transits.transit_s)
    return (ms.groupby(["model", "plan", "device", "sender_computing"]).transit_ms
            .agg(inputs="size", median="median", mean="mean",
                 over_1ms=lambda x: float((x > 1.0).mean())).reset_index())


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
    ap.add_argument("--git", type=int, default=44, help="the last N committed grids")
    ap.add_argument("--plans", default=";".join(PLANS),
                    help="MODEL:LABEL;... (labels as the grids write them)")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    plans = {(model, label) for model, label in (p.split(":", 1) for p in args.plans.split(";"))}
    rows: list[dict] = []
    transits: list[pd.DataFrame] = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in committed_runs(args.git, Path(tmp), args.tag, also=(ACTIONS,)):
            if (folder / ACTIONS.format(tag=args.tag)).exists():
                got, seen = run_rows(folder, plans, args.tag)
                rows += got
                transits += seen
    table = pd.DataFrame(rows)
    if table.empty:
        ap.error(f"none of the last {args.git} committed grids of tag {args.tag!r} kept its "
                 f"actions for the plans {sorted(plans)} (labels as the grids write them, "
                 "e.g. 'mlp:1f1b [4,4] m=16 ckpt=never')")
    summary = summarise(table)
    messages = transit_summary(pd.concat(transits, ignore_index=True))
    meta = {**machine(), "git": args.git, "plans": sorted(args.plans.split(";")),
            "runs": int(table.run.nunique()) if len(table) else 0}
    write_results("phase_errors", table, meta)
    write_results("phase_errors_summary", summary, meta)
    write_results("phase_errors_transits", messages, meta)
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        print(summary.round(2).to_string(index=False))
        print(messages.round(3).to_string(index=False))
    print(f"wrote {RESULTS / 'phase_errors.csv'}")


if __name__ == "__main__":
    main()
