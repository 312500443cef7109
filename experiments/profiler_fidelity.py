"""Profiler fidelity: does the sum of per-layer times equal the whole model's time?

For each built-in model and micro-batch size: the profiler's per-layer forward+backward
medians summed, against the median of the whole model's forward+backward (loss included)
measured in the same process.  The gap is the floor of every later prediction.

    python experiments/profiler_fidelity.py [--repeats 9] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.models import BUILTIN_MODELS, build_model
from executor.profiler import profile, time_whole_model
from experiments.common import machine, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--subdir", default="")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in sorted(BUILTIN_MODELS):
        built = build_model(name)
        batch = built.make_batch(max(sizes))
        prof = profile(built.module, batch, sizes, args.device, loss_fn=built.loss_fn,
                       repeats=args.repeats, warmup=2, dtype=dtype, progress=False)
        for b in sizes:
            whole = time_whole_model(built.module, (batch[0][:b], batch[1][:b]), built.loss_fn,
                                     repeats=args.repeats, warmup=2)
            layers = float(prof.layer_times(b).sum())
            rows.append({"model": name, "micro_batch": b, "layers_sum_ms": layers * 1e3,
                         "whole_model_ms": whole * 1e3, "ratio": layers / whole,
                         "gap_pct": 100 * (layers - whole) / whole})
            print(f"{name:7s} b={b:3d}  layers {layers * 1e3:9.3f} ms  whole {whole * 1e3:9.3f} ms"
                  f"  gap {100 * (layers - whole) / whole:+6.1f}%", flush=True)
    table = pd.DataFrame(rows)
    meta = {**machine(), "device": args.device, "dtype": args.dtype, "repeats": args.repeats,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name(0)
    path = write_results(f"profiler_fidelity_{args.device.split(':')[0]}_{args.dtype}", table, meta,
                         args.subdir)
    print(table.round(3).to_string(index=False))
    print(f"median |gap| {table.gap_pct.abs().median():.1f}%, max |gap| {table.gap_pct.abs().max():.1f}%"
          f"; wrote {path}")


if __name__ == "__main__":
    main()
