"""Which backward autograd's device thread serves first: recorded H100 runs against the model.

Two stages as threads of one process on one GPU hand their backwards to one thread,
autograd's for ``cuda:0``.  When a backward arrives while the other stage's runs, which
one ends first?  Fair sharing says the earlier one; a thread that serves by sequence
number says the one of the worker whose forwards create more autograd nodes
(:mod:`pipesim.simulator`).  For every plan of the project's 2026-11-23 grid
(``experiments/results/gpu/``, every action kept) this counts, per model, dtype, balance
and checkpoint mode, the overlapping pairs of the two stages' backwards, and the share
in which the later one ended first -- measured, and predicted with the engine shared
fairly (``threads_host_gil``) and served by node counts (``threads_node_order``), the
variants of ``repredict_evidence.py``.  It checks the mechanism apart from the costs::

    stage 0   B(0, m)   |=====........=====|      stage 1's backward arrived later and
    stage 1   B(1, m')       |========|           ended first: an overtaking

    python experiments/engine_order.py
Writes experiments/results/engine_order.csv.

    python experiments/engine_order.py --order
re-predicts iteration times with the serving order changed and nothing else (an
ablation): by node counts (``threads_node_order``, the model), stage 0's backward
served first, or both shared fairly -- on the 2026-11-23 grid, the H200's grid of
2026-11-26 and the recorded fp32 traces; prints median and max |error| per source and
model beside the runs' own verdict above.  Writes ``engine_order_ablation.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd

from experiments.common import write_results
from experiments.repredict_evidence import (
    EVIDENCE,
    H200_GRID,
    LATEST_GPU,
    VARIANTS,
    _gpu_plans,
    _with_autograd_nodes,
    trace_runs,
)
from pipesim.profile import Profile
from pipesim.simulator import simulate
from pipesim.trace import metrics

ORDERS = ("threads_host_gil", "threads_node_order")


def overtakings(actions: pd.DataFrame) -> dict[str, int]:
    """Backwards of stage 0 and stage 1 that overlap, by which one started while the other
    ran: ``pairs_1`` (stage 1's arrived later), ``over_1`` (and ended first), likewise
    ``pairs_0`` and ``over_0`` for stage 0's arriving later."""
    b = actions[actions.kind == "B"]
    out = dict.fromkeys(("pairs_1", "over_1", "pairs_0", "over_0"), 0)
    for _, it in b.groupby("iteration"):
        first, second = it[it.stage == 0], it[it.stage == 1]
        for x in first.itertuples():
            for y in second.itertuples():
                if x.start < y.start < x.end:
                    out["pairs_1"] += 1
                    out["over_1"] += int(y.end < x.end)
                elif y.start < x.start < y.end:
                    out["pairs_0"] += 1
                    out["over_0"] += int(x.end < y.end)
    return out


def served(profile: Profile, order: str) -> Profile:
    """``profile`` with its ``autograd_nodes`` set so that autograd's thread serves the
    backwards in ``order``: ``"nodes"`` as counted (the model), ``"stage0"`` stage 0's
    first whatever the balance (each layer more nodes than all after it together: the
    worker holding the first layers outranks), ``"fair"`` shared (all equal: 0)."""
    counted = _with_autograd_nodes(profile)
    if order == "nodes":
        return counted
    layers = counted.table.layer
    nodes = 0 * layers if order == "fair" else 2 ** (counted.n_layers - layers)
    return Profile(counted.table.assign(autograd_nodes=nodes), counted.meta, counted.source)


ORDER_ABLATION = ("nodes", "stage0", "fair")


def order_ablation() -> pd.DataFrame:
    """Each fp32 plan of the GPU grids and traces predicted under every serving order of
    :data:`ORDER_ABLATION` (the ``threads_node_order`` variant, its profile's node counts
    replaced): one row per plan and order, error in percent of the measured iteration."""
    runs = [("gpu_results", model, dtype, profile, cluster, plan, r.measured_ms)
            for model, dtype, profile, cluster, plan, r in _gpu_plans(LATEST_GPU)]
    runs += [("h200_grid", model, dtype, profile, cluster, plan, r.measured_ms)
             for model, dtype, profile, cluster, plan, r in _gpu_plans(H200_GRID)]
    runs += [("traces", model, dtype, profile, cluster, plan,
              metrics(measured).iteration_time_s * 1e3)
             for model, dtype, profile, cluster, plan, measured in trace_runs(EVIDENCE)]
    rows = []
    for source, model, dtype, profile, cluster, plan, measured_ms in runs:
        if dtype != "float32":
            continue
        for order in ORDER_ABLATION:
            changed = VARIANTS["threads_node_order"](served(profile, order), cluster)
            if changed is None:
                continue
            predicted = metrics(simulate(changed[0], plan, changed[1],
                                         track_memory=False)).iteration_time_s * 1e3
            rows.append({"source": source, "model": model, "plan": plan.label(),
                         "order": order, "measured_ms": measured_ms,
                         "predicted_ms": predicted,
                         "error_pct": 100 * (predicted / measured_ms - 1)})
    table = pd.DataFrame(rows)
    summary = table.assign(abs_error=table.error_pct.abs()).pivot_table(
        index=["source", "model"], columns="order", values="abs_error",
        aggfunc=["median", "max"])
    with pd.option_context("display.width", 200):
        print("iteration time, |error| % by the order autograd's thread serves backwards in")
        print(summary.round(2).to_string())
    write_results("engine_order_ablation", table, {"orders": list(ORDER_ABLATION)})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", action="store_true",
                    help="re-predict iteration times under each serving order (an ablation)")
    if ap.parse_args().order:
        order_ablation()
        return
    recorded = pd.read_csv(LATEST_GPU / "validation_gpu_actions.csv.gz")
    rows = []
    for model, dtype, profile, cluster, plan, _ in _gpu_plans(LATEST_GPU):
        label = f"{model}/{dtype}/2st"
        measured = recorded[(recorded.model == label) & (recorded.plan == plan.label())]
        row: dict = {"model": model, "dtype": dtype,
                     "balance": str(list(plan.balance)).replace(" ", ""),
                     "checkpoint": plan.checkpoint}
        row.update({f"measured_{k}": v for k, v in overtakings(measured).items()})
        for variant in ORDERS:
            changed = VARIANTS[variant](profile, cluster)
            if changed is not None:
                trace = simulate(changed[0], plan, changed[1], track_memory=False)
                row.update({f"{variant}_{k}": v for k, v in overtakings(trace.actions).items()})
        rows.append(row)
    summary = pd.DataFrame(rows).groupby(["model", "dtype", "balance", "checkpoint"]).sum(
        numeric_only=True).reset_index()
    out = summary[["model", "dtype", "balance", "checkpoint"]].copy()
    for stage in (1, 0):
        out[f"pairs_{stage}"] = summary[f"measured_pairs_{stage}"]
        for source in ("measured", *ORDERS):
            pairs = summary.get(f"{source}_pairs_{stage}")
            if pairs is not None:
                out[f"{source}_{stage}"] = (summary[f"{source}_over_{stage}"]
                                            / pairs.where(pairs > 0))
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print("share of overlapping backward pairs in which the one that arrived later ended "
              "first (_1: stage 1's arrived later, _0: stage 0's)")
        print(out.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    agree: dict[str, list[int]] = {}
    for v in ORDERS:
        hits = []
        for stage in (1, 0):
            both = out[[f"measured_{stage}", f"{v}_{stage}"]].dropna()
            hits += list((both.iloc[:, 0] > 0.5) == (both.iloc[:, 1] > 0.5))
        agree[v] = [int(sum(hits)), len(hits)]
    print("cases (group and direction, where the model has such pairs too) in which model and "
          "run agree on whether the later backward ends first: "
          + ", ".join(f"{v} {a} of {n}" for v, (a, n) in agree.items()))
    write_results("engine_order", out, {"source": str(LATEST_GPU), "variants": list(ORDERS),
                                        "agreement": agree})


if __name__ == "__main__":
    main()
