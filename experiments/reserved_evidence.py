"""The reserved-memory estimate against the CUDA allocator's own segments (H100 snapshots).

The 2026-11-23 GPU grid (``experiments/results/gpu/``) saved the allocator's snapshot
(``torch.cuda.memory._snapshot``) of 8 plans (gpt and mlp, fp32 and bf16, GPipe and 1F1B,
4 micro-batches, checkpoint ``always``).  Each holds the segments the allocator reserved,
per stream, and the last allocations.  What the pipeline reserved is the default stream's
segments (parameters, the batch) and those of the streams that allocated during the run;
the other streams are the profiler's side streams that run held on to (99 MiB of cuBLAS
workspaces each, a leak fixed since).  Each plan is predicted from the grid's profile and
calibration: peak allocated, and :func:`pipesim.allocator.reserved_peaks` with the H100
assumptions, counted with the streams the snapshot shows running the pipeline.

    python experiments/reserved_evidence.py
Writes experiments/results/reserved_evidence.csv / .json.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd

from experiments.common import write_results
from experiments.repredict_evidence import LATEST_GPU, _batch_bytes, _gpu_plans
from pipesim.allocator import CUDA_H100, MiB, reserved_peaks
from pipesim.simulator import simulate
from pipesim.trace import metrics


def snapshot_reserved(path: Path) -> tuple[int, int]:
    """``(reserved bytes, pipeline streams)``: the default stream's segments and those of
    the streams that allocated in the snapshot's trace."""
    snap = pickle.loads(path.read_bytes())
    trace = snap["device_traces"][0]
    active = {e["stream"] for e in trace if e["action"] == "alloc"} - {0}
    reserved = sum(s["total_size"] for s in snap["segments"] if s["stream"] in active | {0})
    return reserved, len(active)


def main() -> None:
    plans = {(model, dtype, plan.schedule, plan.chunks, plan.checkpoint): (profile, cluster, plan, r)
             for model, dtype, profile, cluster, plan, r in _gpu_plans(LATEST_GPU)}
    rows = []
    for path in sorted((LATEST_GPU / "snapshots").glob("*.pickle")):
        model, dtype, _, schedule, chunks, checkpoint = path.stem.split("_")
        profile, cluster, plan, r = plans[(model, dtype, schedule, int(chunks[1:]), checkpoint)]
        reserved, streams = snapshot_reserved(path)
        trace = simulate(profile, plan, cluster)
        allocated = sum(metrics(trace).peak_memory_bytes.values()) + _batch_bytes(model, dtype)
        estimate = sum(reserved_peaks(trace, CUDA_H100, {"cuda:0": streams}).values())
        estimate += _batch_bytes(model, dtype)
        rows.append({"model": model, "dtype": dtype, "plan": plan.label(),
                     "measured_allocated_mib": r.peak_meas_bytes / MiB,
                     "predicted_allocated_mib": allocated / MiB,
                     "measured_reserved_mib": reserved / MiB, "pipeline_streams": streams,
                     "estimated_reserved_mib": estimate / MiB,
                     "allocated_as_reserved_err_pct": 100 * (allocated / reserved - 1),
                     "reserved_err_pct": 100 * (estimate / reserved - 1)})
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200):
        print(table.round(1).to_string(index=False))
    err = table.reserved_err_pct
    print(f"reserved estimate: median |error| {err.abs().median():.1f}%, max {err.abs().max():.1f}%, "
          f"under in {int((err < 0).sum())} of {len(err)}; predicted allocated as reserved: median "
          f"{table.allocated_as_reserved_err_pct.median():+.1f}%")
    write_results("reserved_evidence", table, {"allocator": repr(CUDA_H100),
                                               "snapshots": str(LATEST_GPU / "snapshots")})


if __name__ == "__main__":
    main()
