"""In-process executor on one GPU: its step time against the unpipelined model.

Stages as worker threads on one device (``cuda:0``; ``--device cpu`` for a smoke run),
gpt as in the recorded H100 evidence, fp32 and bf16, 2 and 4 stages, chunks 1 and 4,
checkpoint ``never``.  Per configuration: median step time over ``--iterations`` (after
warm-up) and its spread, beside the unpipelined model's forward+backward on the same
batch.  The workers are long-lived (one per stage for the Pipeline's life), so a
thread's first CUDA work is paid once, in the warm-up.

    python experiments/bench_executor_cuda.py [--device cuda:0] [--iterations 20] [--quick]
Target: at m=1 the pipeline within 5% of the unpipelined model.
Writes experiments/results/[gpu/]bench_executor_cuda.csv (written as it goes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.models import builtin_job
from executor.pipeline import Pipeline
from executor.timing import synchronize
from experiments.common import machine, write_results
from pipesim.balance import even_balance
from pipesim.plan import Plan

GPT = dict(vocab=8192, d_model=1024, n_layers=8, n_heads=16, seq_len=256)
QUICK = dict(vocab=256, d_model=64, n_layers=4, n_heads=4, seq_len=16)


def unpipelined(module, loss_fn, x, y, device, iterations: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + iterations):
        module.zero_grad(set_to_none=True)
        synchronize(device)
        t0 = time.perf_counter()
        loss_fn(module(x), y).backward()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--subdir", default="gpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for dtype in ("float32", "bfloat16"):
        module, loss_fn, x, y = builtin_job("gpt", 32, dtype=dtype, **(QUICK if args.quick else GPT))
        module.to(device)
        x, y = x.to(device), y.to(device)
        base = unpipelined(module, loss_fn, x, y, device, args.iterations, 3)
        for stages in (2, 4):
            for chunks in (1, 4):
                plan = Plan(even_balance(len(module), stages), chunks, 32, checkpoint="never")
                its = []
                with Pipeline(module, plan, [device] * stages, loss_fn, track_memory=False) as pipe:
                    for i in range(3 + args.iterations):  # wall time of the whole step
                        module.zero_grad(set_to_none=True)
                        synchronize(device)
                        t0 = time.perf_counter()
                        pipe.step(x, y)
                        synchronize(device)
                        if i >= 3:
                            its.append(time.perf_counter() - t0)
                med, ref = statistics.median(its), statistics.median(base)
                rows.append({"dtype": dtype, "stages": stages, "chunks": chunks,
                             "pipeline_ms": 1e3 * med, "unpipelined_ms": 1e3 * ref,
                             "ratio": med / ref, "spread_ms": 1e3 * (max(its) - min(its))})
                print(rows[-1], flush=True)
                write_results("bench_executor_cuda", pd.DataFrame(rows),
                              {**machine(), "device": str(device), "torch": torch.__version__,
                               "model": QUICK if args.quick else GPT}, args.subdir)


if __name__ == "__main__":
    main()
