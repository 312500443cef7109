"""How much each kind of action slows the other stage's actions, read off a GPU grid.

Two stages as threads of one process on one GPU share its streams, the interpreter and
autograd's thread for the device.  Which pairs of actions get in each other's way?  For
every plan of a ``gpu_validate.py`` grid with at least ``--min-chunks`` micro-batches
(where the stages overlap most) and every measured forward and backward, this takes the
action's excess over its stage's cost measured in place (``in_place_costs_gpu*.json``
beside the grid, :meth:`pipesim.cluster.Cluster.in_place_cost`) and how long it overlapped
each kind of the other stage's actions -- ``F``, ``B``, and ``Fc``, ``Bc`` checkpointed --
and fits, per model and kind, the seconds lost per second of overlap (least squares, no
intercept)::

    stage 0   Bc(0, m)   |=====================|      excess = 1.1 x 6 ms: it lost
    stage 1   F(1, m+1)       |=====6 ms=====|        what it overlapped, and more

A coefficient near 1 is two actions taking turns, near 0 two running together.  It is a
diagnosis of the grid, not a calibration: ``experiments/thread_interpreter.py`` measures
the same pairs on a micro-benchmark (``gpu_run.sh threads``).  The H200 grid of
2026-11-26 (gpt, 8-16 micro-batches): a checkpointed backward loses 1.1-1.35 beside
forwards and 0.5 beside another checkpointed backward; the thread model charges nearly the
reverse.

``--fit-pairs`` asks whether sharing by pairs (:attr:`pipesim.cluster.Cluster.thread_pairs`)
*can* represent the grid: the same fit per model and micro-batch size, each coefficient
``c`` read as the pair's ratio ``1 / (1 - c)`` (an action beside that pass progresses at
``1 - c`` of its speed; ``c`` clipped to [0, 0.95]), and every plan predicted again with
those pairs and the in-place costs.  Fitted on the grid it predicts: an upper bound on
what the mechanism can do there, never a validation (the profiler measures the pairs
apart: ``profile(..., pairs=True)``).

    python experiments/interference_by_kind.py [--folder DIR] [--min-chunks 8] [--fit-pairs]
Writes experiments/results/interference_by_kind.csv (and with --fit-pairs
interference_pairs_fitted.csv: each plan's error with the fitted pairs and without).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import pandas as pd

from experiments.common import write_results
from experiments.repredict_evidence import H200_GRID, _gpu_plans, _threads, in_place_costs
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import PAIRS, Profile
from pipesim.readings import in_place_costs_of
from pipesim.simulator import simulate
from pipesim.trace import metrics

#: the kinds an overlapping action can be (``c``: checkpointed)
KINDS = ("F", "Fc", "B", "Bc")


def kind_of(plan: Plan, kind: str, mb: int) -> str:
    """``F``/``B``, with ``c`` where the micro-batch is checkpointed."""
    return kind + ("c" if plan.checkpointed(mb) else "")


def overlaps(plan: Plan, cluster: Cluster, actions: pd.DataFrame) -> list[dict]:
    """Per forward and backward of one plan's measured ``actions`` (columns ``iteration,
    stage, microbatch, kind, start, end``): its kind, excess over its lone cost in place
    (seconds) and its overlap (seconds) with each kind of the other stages' actions."""
    rows = []
    sizes = plan.micro_batch_sizes
    for _, it in actions.groupby("iteration"):
        acts = list(it.itertuples())
        for a in acts:
            layers = plan.stage_layers(a.stage)
            lone = cluster.in_place_cost(layers.start, layers.stop, sizes[a.microbatch],
                                         plan.checkpointed(a.microbatch))
            if lone is None:
                continue
            overlap = dict.fromkeys(KINDS, 0.0)
            for b in acts:
                if b.stage != a.stage:
                    overlap[kind_of(plan, b.kind, b.microbatch)] += max(
                        0.0, min(a.end, b.end) - max(a.start, b.start))
            rows.append({"kind": kind_of(plan, a.kind, a.microbatch),
                         "micro_batch": sizes[a.microbatch],
                         "excess_s": (a.end - a.start) - lone[0 if a.kind == "F" else 1],
                         **{f"overlap_{k}": v for k, v in overlap.items()}})
    return rows


def fit(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and kind: the least-squares seconds lost per second of overlap with each
    kind of the other stage's actions, the actions counted and their median excess."""
    out = []
    cols = [f"overlap_{k}" for k in KINDS]
    for (model, kind), part in table.groupby(["model", "kind"]):
        coef, *_ = np.linalg.lstsq(part[cols].to_numpy(), part.excess_s.to_numpy(), rcond=None)
        out.append({"model": model, "kind": kind, "actions": len(part),
                    "median_excess_ms": 1e3 * part.excess_s.median(),
                    **{f"beside_{k}": c for k, c in zip(KINDS, coef, strict=True)}})
    return pd.DataFrame(out)


def fitted_pairs(table: pd.DataFrame) -> dict[str, dict[str, float]]:
    """``meta["pair_slowdown"]`` read off one model's fit per size (:func:`fit` of the
    rows at each ``micro_batch``): ``"X|Y"`` is ``1 / (1 - c)``, ``c`` the seconds X lost
    per second beside Y clipped to [0, 0.95]; 1 for a pair the grid never overlapped."""
    out = {}
    for size, part in table.groupby("micro_batch"):
        row = dict.fromkeys(PAIRS, 1.0)
        for r in fit(part.assign(model="")).itertuples():
            for other in KINDS:
                c = min(max(float(getattr(r, f"beside_{other}")), 0.0), 0.95)
                if part[f"overlap_{other}"][part.kind == r.kind].sum() > 0:
                    row[f"{r.kind}|{other}"] = 1.0 / (1.0 - c)
        out[str(int(size))] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=H200_GRID)
    ap.add_argument("--min-chunks", type=int, default=8)
    ap.add_argument("--fit-pairs", action="store_true",
                    help="also fit pairs per size and predict the grid with them (in-sample)")
    args = ap.parse_args()
    costs = in_place_costs(args.folder)
    if not costs:
        raise SystemExit(f"{args.folder}: no in_place_costs_gpu*.json beside the grid "
                         "(gpu_validate.py --in-place-only measures them)")
    actions = pd.read_csv(args.folder / "validation_gpu_actions.csv.gz")
    actions = actions[actions.kind.isin(["F", "B"])]
    rows, all_rows = [], []
    plans = list(_gpu_plans(args.folder))
    for model, dtype, _, cluster, plan, r in plans:
        label = f"{model}/{dtype}/{plan.n_stages}st"
        if label not in costs or (plan.chunks < args.min_chunks and not args.fit_pairs):
            continue
        placed = dataclasses.replace(cluster, in_place_costs=in_place_costs_of(costs[label]))
        mine = actions[(actions.model == r.model) & (actions.plan == plan.label())]
        found = [{"model": model, **row} for row in overlaps(plan, placed, mine)]
        all_rows += found
        if plan.chunks >= args.min_chunks:
            rows += found
    table = fit(pd.DataFrame(rows))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_results("interference_by_kind", table, {"folder": str(args.folder),
                                                  "min_chunks": args.min_chunks})
    if args.fit_pairs:
        predict_with_fitted_pairs(pd.DataFrame(all_rows), plans, costs, args.folder)


def predict_with_fitted_pairs(table: pd.DataFrame, plans: list, costs: dict,
                              folder: Path) -> None:
    """Every plan of the grid with pairs fitted on its own actions (in-sample: see the
    module doc) against the in-place costs as predicted today (``measured_streams``)."""
    pairs = {model: fitted_pairs(part) for model, part in table.groupby("model")}
    out = []
    for model, dtype, profile, cluster, plan, r in plans:
        label = f"{model}/{dtype}/{plan.n_stages}st"
        if label not in costs:
            continue
        placed = dataclasses.replace(cluster, in_place_costs=in_place_costs_of(costs[label]),
                                     device_sharing="concurrent")
        paired = dataclasses.replace(_threads(placed), thread_pairs=True)
        with_pairs = Profile(profile.table, {**profile.meta, "pair_slowdown": pairs[model]},
                             profile.source)
        out.append({"model": model, "dtype": dtype, "plan": plan.label(),
                    "measured_ms": r.measured_ms,
                    "in_place_costs_ms": 1e3 * metrics(simulate(
                        profile, plan, placed, track_memory=False)).iteration_time_s,
                    "fitted_pairs_ms": 1e3 * metrics(simulate(
                        with_pairs, plan, paired, track_memory=False)).iteration_time_s})
    result = pd.DataFrame(out)
    for col in ("in_place_costs_ms", "fitted_pairs_ms"):
        result[col.replace("_ms", "_err_pct")] = 100 * (result[col] / result.measured_ms - 1)
    for model, part in result.groupby("model"):
        for col in ("in_place_costs_err_pct", "fitted_pairs_err_pct"):
            err = part[col].abs()
            print(f"{model} {col[:-8]:15s}: median |error| {err.median():5.1f}%, "
                  f"max {err.max():5.1f}%")
    write_results("interference_pairs_fitted", result,
                  {"folder": str(folder), "pairs": pairs,
                   "note": "pairs fitted on the grid they predict: an upper bound"})


if __name__ == "__main__":
    main()
