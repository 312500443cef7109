"""Executor speed: pipesim's multi-process executor against torch.distributed.pipelining.

2 processes x 1 thread each on this machine (gloo), the same model, split and micro-batches:

* pipesim ``gpipe`` and ``1f1b`` (checkpoint ``never``), through ``executor.distributed``;
* torch.distributed.pipelining ``ScheduleGPipe`` and ``Schedule1F1B`` on the same stages;
* the plain unpipelined model in one process with one thread.

Step time = wall seconds from a barrier to the end of the step (all sends done), the
maximum over ranks, median over iterations.  Also: pipesim's overhead against an ideal
timeline, the simulator replaying the run's own measured action durations with free
links and no overheads.

    python experiments/bench_executor.py [--iterations 20] [--model mlp]
Target: pipesim at most 1.0x torch.distributed.pipelining's step time.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.distributed import _free_port, spawn_plans
from executor.models import builtin_job
from executor.partition import split_module
from executor.profiler import profile
from experiments.common import machine, write_results
from pipesim.plan import Plan
from pipesim.simulator import simulate
from pipesim.trace import metrics

MODELS = {"mlp": dict(width=1024, depth=8, in_features=1024),
          "gpt": dict(vocab=2048, d_model=256, n_layers=6, n_heads=4, seq_len=64)}


def torch_rank(rank: int, port: int, job, balance, chunks, schedule_name, iterations, warmup,
               out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module, loss_fn, x, y = job()
    stage_mod = split_module(module, balance)[rank]
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    sched = cls(stage, n_microbatches=chunks, loss_fn=loss_fn)
    walls = []
    for _ in range(warmup + iterations):
        stage_mod.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        walls.append(time.perf_counter() - t0)
    out.put((rank, walls[warmup:]))
    dist.destroy_process_group()


def run_torch(job, balance, chunks, schedule, iterations, warmup) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=torch_rank, args=(r, port, job, balance, chunks, schedule,
                                                  iterations, warmup, out)) for r in range(2)]
    for p in procs:
        p.start()
    walls = dict(out.get(timeout=600) for _ in range(2))
    for p in procs:
        p.join()
    return [max(a, b) for a, b in zip(walls[0], walls[1], strict=True)]


def run_single(job, iterations, warmup) -> list[float]:
    torch.set_num_threads(1)
    module, loss_fn, x, y = job()
    walls = []
    for _ in range(warmup + iterations):
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss_fn(module(x), y).backward()
        walls.append(time.perf_counter() - t0)
    return walls[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    job = functools.partial(builtin_job, args.model, args.batch, **MODELS[args.model])
    module, loss_fn, x, y = job()
    n = len(module)
    balance = [n - n // 2, n // 2]
    rows = []
    single = statistics.median(run_single(job, args.iterations, args.warmup))
    rows.append({"executor": "unpipelined (1 process, 1 thread)", "schedule": "-",
                 "step_ms": single * 1e3})
    print(f"unpipelined: {single * 1e3:.2f} ms", flush=True)
    torch.set_num_threads(1)
    prof = profile(module, (x, y), [args.batch // args.chunks], loss_fn=loss_fn, repeats=3,
                   progress=False)
    plans = [Plan(balance, args.chunks, args.batch, checkpoint="never", schedule=s)
             for s in ("gpipe", "1f1b")]
    # no memory tracking: torch.distributed.pipelining has none either
    results = spawn_plans(job, plans, iterations=args.iterations, warmup=args.warmup,
                          track_memory=False)
    for plan, (result, ranks) in zip(plans, results, strict=True):
        walls = [max(w) for w in zip(*(r.step_wall_s for r in ranks.values()), strict=True)]
        step = statistics.median(walls)
        # ideal: the run's own measured durations, free links, no overheads
        a = result.trace.actions
        ideal = []
        for it in sorted(a.iteration.unique()):
            part = a[(a.iteration == it) & a.kind.isin(["F", "B"])]
            durations = {(r.stage, r.kind, r.microbatch): r.end - r.start for r in part.itertuples()}
            ideal.append(metrics(simulate(prof, plan, durations=durations)).iteration_time_s)
        ideal_s = statistics.median(ideal)
        torch_walls = run_torch(job, balance, args.chunks, plan.schedule, args.iterations,
                                args.warmup)
        torch_step = statistics.median(torch_walls)
        rows.append({"executor": "pipesim (2 processes)", "schedule": plan.schedule,
                     "step_ms": step * 1e3, "ideal_ms": ideal_s * 1e3,
                     "overhead_vs_ideal_pct": 100 * (step / ideal_s - 1),
                     "ratio_vs_torch": step / torch_step, "speedup_vs_unpipelined": single / step})
        rows.append({"executor": "torch.distributed.pipelining (2 processes)",
                     "schedule": plan.schedule, "step_ms": torch_step * 1e3,
                     "speedup_vs_unpipelined": single / torch_step})
        print(f"{plan.schedule}: pipesim {step * 1e3:.2f} ms (ideal {ideal_s * 1e3:.2f} ms), "
              f"torch {torch_step * 1e3:.2f} ms, ratio {step / torch_step:.3f}", flush=True)
    table = pd.DataFrame(rows)
    meta = {**machine(), "model": args.model, "sizes": MODELS[args.model], "batch": args.batch,
            "chunks": args.chunks, "balance": balance, "iterations": args.iterations,
            "warmup": args.warmup, "torch": torch.__version__, "threads_per_rank": 1,
            "cpus_available": len(os.sched_getaffinity(0))}
    path = write_results(f"bench_executor_{args.model}", table, meta)
    print(table.round(3).to_string(index=False))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
