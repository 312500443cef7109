"""The 14 recorded H100 memory cases re-predicted from a profile taken here, on CPU.

``../shared/evidence/h100-2026-11-22/thread_and_memory_results.txt`` holds, for gpt
(vocab 8192, d_model 1024, 8 layers, 16 heads, seq 256, batch 32; balance [5,5], both
stages as threads on one H100), ``torch.cuda.max_memory_allocated`` of fresh processes.
Bytes do not depend on the device except where kernels differ, so the model is profiled
here on CPU (in the same dtype) at micro-batches of 1 and 2 samples -- bytes are linear
in the micro-batch size -- and extrapolated to 2, 8 and 32.  The prediction adds the
batch (token ids on the device) as the recorded runs held it.

The 14 plans were run again on 2026-11-23 by today's executor (``gpu_validate.py``, in
``experiments/results/gpu/validation_gpu.csv``: the plan's own allocator peak, memory of
earlier plans excluded).  Each case is also compared with that measurement
(``measured_today_bytes``, ``error_vs_today_pct``), and the difference between the two
measurements is printed: where the plan ran the same way it is one constant, memory the
2026-11-22 executor counted that is not the plan's (its peak was the process's absolute
``max_memory_allocated``).  The recordings are fresh processes: their peaks hold the
cuBLAS workspaces of each worker's stream (:func:`pipesim.allocator.allocated_peaks`, the
H100 assumption of :data:`pipesim.allocator.CUDA_H100`: 99 MiB a stream, read off the
2026-11-23 snapshots), which the prediction adds (``error_pct``; the tensors alone:
``error_tensors_only_pct``); today's peaks, measured from a baseline that already holds
them, are compared with the tensors alone.  A second table compares
the CPU profile's byte columns with the GPU profile recorded beside the traces, layer by
layer: where they differ, the kernels do.

With ``--grid``, every gpt plan of that 2026-11-23 grid (120: fp32 and bf16) is
predicted again the same way: the grid's own H100 profile (its seconds, so the two
stages' memory overlaps as they ran) with the byte columns of the CPU profile, which
carry the raw backward rises the H100 profile predates (``bwd_rise_bytes``,
``bwd_fed_rise_bytes``), against the plan's own allocator peak
(``memory_evidence_grid.csv``): the memory model of today on the GPU grid, without a GPU.

    python experiments/memory_evidence.py [--evidence DIR] [--grid]
Writes experiments/results/memory_evidence.csv and memory_evidence_bytes.csv (and
memory_evidence_grid.csv).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd
import torch

from executor.models import builtin_job
from executor.profiler import profile
from experiments.common import write_results
from experiments.repredict_evidence import EVIDENCE, LATEST_GPU, _batch_bytes, _gpu_plans
from experiments.validation import TRANSIENTS, without_columns
from pipesim.allocator import CUDA_H100, allocated_peaks
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.simulator import simulate
from pipesim.trace import metrics

GPT = dict(vocab=8192, d_model=1024, n_layers=8, n_heads=16, seq_len=256)
BATCH = 32
#: byte columns compared between the CPU and the CUDA profile, layer by layer
BYTE_COLUMNS = ("saved_bytes", "output_bytes", "fwd_transient_bytes", "bwd_transient_bytes",
                "bwd_rise_bytes", "bwd_fed_rise_bytes")


def parse_plan(label: str) -> Plan:
    """``"gpipe [5,5] m=4 ckpt=never"`` -> Plan (batch 32)."""
    schedule, balance, chunks, ckpt = label.split()
    return Plan([int(b) for b in balance.strip("[]").split(",")], int(chunks[2:]), BATCH,
                checkpoint=ckpt.split("=")[1], schedule=schedule)


def cases(evidence: Path) -> list[dict]:
    lines = (evidence / "thread_and_memory_results.txt").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def measured_today(dtype: str, plan: Plan) -> float:
    """The same plan's peak in today's H100 grid (:data:`LATEST_GPU`), NaN if absent."""
    path = LATEST_GPU / "validation_gpu.csv"
    if not path.exists():
        return float("nan")
    grid = pd.read_csv(path, dtype={"balance": str})
    same = grid[(grid.model == f"gpt/{dtype}/2st")
                & (grid.balance == ",".join(map(str, plan.balance)))
                & (grid.chunks == plan.n_microbatches) & (grid.checkpoint == plan.checkpoint)
                & (grid.schedule == plan.schedule)]
    return float(same.peak_meas_bytes.iloc[0]) if len(same) else float("nan")


def cpu_profile(dtype: str) -> Profile:
    module, loss_fn, x, y = builtin_job("gpt", 2, dtype=dtype, **GPT)
    return profile(module, (x, y), [1, 2], loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, meta={"model": "gpt", **GPT})


#: the byte columns a CPU profile lends a GPU profile of the same model (bytes do not
#: depend on the device where the kernels agree: ``memory_evidence_bytes.csv``)
LENT_COLUMNS = ("input_bytes", "output_bytes", "saved_bytes", "saved_input_bytes",
                "saved_output_bytes", "fwd_transient_bytes", "bwd_transient_bytes",
                "bwd_rise_bytes", "bwd_fed_rise_bytes")


def with_bytes_of(timed: Profile, sized: Profile) -> Profile:
    """``timed`` (its seconds) with the byte columns of ``sized`` (:data:`LENT_COLUMNS`),
    read at each of ``timed``'s sizes (bytes are linear in the micro-batch size: a CPU
    profile at 1 and 2 samples extrapolates exactly)."""
    table = timed.table.copy()
    for column in LENT_COLUMNS:
        if column in sized.table.columns:
            table[column] = [float(sized.at(int(r.layer), float(r.micro_batch),
                                            extrapolate=True)[column])
                             for r in table.itertuples()]
    return Profile(table, timed.meta, timed.source)


def grid_cases(prof: Profile, dtype: str) -> pd.DataFrame:
    """Every gpt plan of the 2026-11-23 H100 grid in ``dtype`` predicted with the grid's
    profile lent ``prof``'s bytes (:func:`with_bytes_of`), beside its allocator peak and
    the peak that grid's own profile predicts today (see the module doc)."""
    rows = []
    lent: Profile | None = None
    for model, kind, gpu_profile, cluster, plan, r in _gpu_plans(LATEST_GPU):
        if model != "gpt" or kind != dtype:
            continue
        if lent is None:  # (one profile serves the grid's plans)
            lent = with_bytes_of(gpu_profile, prof)
        peaks = {name: sum(metrics(simulate(p, plan, cluster)).peak_memory_bytes.values())
                 + _batch_bytes(model, dtype) for name, p in (("lent", lent), ("own", gpu_profile))}
        rows.append({"dtype": dtype, "plan": plan.label(), "measured_bytes": r.peak_meas_bytes,
                     "predicted_bytes": peaks["lent"],
                     "error_pct": 100 * (peaks["lent"] / r.peak_meas_bytes - 1),
                     "predicted_own_profile_bytes": peaks["own"],
                     "error_own_profile_pct": 100 * (peaks["own"] / r.peak_meas_bytes - 1)})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evidence", type=Path, default=EVIDENCE)
    ap.add_argument("--grid", action="store_true",
                    help="also every gpt plan of the 2026-11-23 H100 grid (see the module doc)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    records = cases(args.evidence)
    grid_rows = []
    rows, byte_rows = [], []
    for dtype in ("float32", "bfloat16"):
        prof = cpu_profile(dtype)
        without = without_columns(prof, TRANSIENTS)
        if args.grid:
            grid_rows.append(grid_cases(prof, dtype))
        batch_bytes = _batch_bytes("gpt", dtype)  # token ids and targets, int64
        for r in (r for r in records if r["dtype"] == dtype):
            plan = parse_plan(r["plan"])
            cluster = Cluster.shared_gpu(2)
            measured = r["measured"]
            preds = {}
            for name, p in (("with_transients", prof), ("without_transients", without)):
                trace = simulate(p, plan, cluster, extrapolate=True)
                # a fresh process: the tensors' peak and each worker stream's cuBLAS
                # workspaces, which the allocator holds from the first matmul on
                preds[name] = max(allocated_peaks(trace, CUDA_H100).values()) + batch_bytes
                if name == "with_transients":
                    tensors = max(metrics(trace).peak_memory_bytes.values()) + batch_bytes
            today = measured_today(dtype, plan)
            rows.append({"dtype": dtype, "plan": r["plan"], "measured_bytes": measured,
                         "predicted_bytes": preds["with_transients"],
                         "error_pct": 100 * (preds["with_transients"] / measured - 1),
                         "predicted_tensors_bytes": tensors,
                         "error_tensors_only_pct": 100 * (tensors / measured - 1),
                         "measured_today_bytes": today,
                         "recorded_minus_today_MiB": (measured - today) / 2**20,
                         # (today's peaks are measured from a baseline that holds the
                         # workspaces of the plans before: the tensors' peak alone)
                         "error_vs_today_pct": 100 * (tensors / today - 1),
                         "error_without_transients_pct":
                             100 * (preds["without_transients"] / measured - 1),
                         "recorded_prediction_error_pct": r["err_pct"]})
        # the H100 profile of the same gpt: this project's latest GPU run (it has the
        # transient columns), else the one recorded beside the evidence's traces
        latest = ROOT / "experiments" / "results" / "gpu" / f"profile_gpt_{dtype}.csv"
        gpu = Profile.load(latest if latest.exists()
                           else args.evidence / "traces" / f"gpt_{dtype}" / "profile.csv")
        columns = [c for c in BYTE_COLUMNS if c in gpu.table.columns and c in prof.table.columns]
        for layer in range(prof.n_layers):
            here, there = prof.at(layer, 2), gpu.at(layer, 2)
            row = {"dtype": dtype, "layer": layer, "name": prof.layer_names[layer],
                   "cuda_profile": str(gpu.source)}
            for c in columns:
                row[f"{c}_cpu"], row[f"{c}_cuda"] = here[c], there[c]
                row[f"{c}_diff_pct"] = (100 * (here[c] / there[c] - 1) if there[c]
                                        else (0.0 if not here[c] else float("inf")))
            byte_rows.append(row)
    table = pd.DataFrame(rows)
    write_results("memory_evidence", table, {"evidence": str(args.evidence)})
    write_results("memory_evidence_bytes", pd.DataFrame(byte_rows), {"size": 2})
    with pd.option_context("display.width", 160):
        print(table.round(2).to_string(index=False))
        diffs = pd.DataFrame(byte_rows)
        print(diffs[["dtype", "layer", "name"] + [c for c in diffs.columns if c.endswith("_pct")]]
              .round(2).to_string(index=False))
    for dtype, part in table.groupby("dtype"):
        print(f"{dtype}: median |error| {part.error_pct.abs().median():.1f}%, max "
              f"{part.error_pct.abs().max():.1f}% (without transients "
              f"{part.error_without_transients_pct.abs().median():.1f}% / "
              f"{part.error_without_transients_pct.abs().max():.1f}%; as recorded "
              f"{part.recorded_prediction_error_pct.abs().median():.1f}% / "
              f"{part.recorded_prediction_error_pct.abs().max():.1f}%)")
    err = table.error_pct.abs()
    print(f"all 14: median |error| {err.median():.1f}%, max {err.max():.1f}% (the tensors "
          f"alone, no workspaces: {table.error_tensors_only_pct.abs().median():.1f}% / "
          f"{table.error_tensors_only_pct.abs().max():.1f}%)")
    if grid_rows:
        grid = pd.concat(grid_rows, ignore_index=True)
        write_results("memory_evidence_grid", grid, {"grid": str(LATEST_GPU)})
        for dtype, part in grid.groupby("dtype"):
            print(f"the H100 grid's gpt {dtype} ({len(part)} plans), lent the CPU profile's "
                  f"bytes: median |error| {part.error_pct.abs().median():.2f}%, max "
                  f"{part.error_pct.abs().max():.1f}% (its own profile's bytes: "
                  f"{part.error_own_profile_pct.abs().median():.2f}% / "
                  f"{part.error_own_profile_pct.abs().max():.1f}%)")
        worst = grid.reindex(grid.error_pct.abs().sort_values().index[-6:])
        print(worst.round(2).to_string(index=False))
    today = table.error_vs_today_pct.dropna().abs()
    if len(today):
        offsets = table.recorded_minus_today_MiB.round(3).value_counts()
        print(f"against today's executor on the same plans ({len(today)}): median |error| "
              f"{today.median():.1f}%, max {today.max():.1f}%; recorded minus today "
              f"(MiB: cases) {offsets.to_dict()}")


if __name__ == "__main__":
    main()
