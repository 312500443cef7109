"""torch.distributed.pipelining's own runtime as a second executor, predicted by pipesim.

For each model, rank count (gloo processes on this CPU) and schedule class -- GPipe, 1F1B,
Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, plus pipesim's own
zb-h1 and zbv written to torch's CSV and run by torch's ``_PipelineScheduleRuntime`` --
this script

1. builds ``PipelineStage``s on the split pipesim would use and times torch's
   ``schedule.step`` (every rank: a barrier, the step, the latest end over the ranks);
2. runs the very same schedule (read with :func:`executor.torch_schedules.from_torch`)
   through pipesim's executor (``executor.distributed``) on the same processes' layout;
3. predicts both with pipesim from one profile (split backward measured) and a
   calibration of *torch's* runtime: gloo links and host contention as for pipesim's
   executor (machine properties), torch's cost per action fitted on a micro-benchmark
   (GPipe on one tiny linear layer a stage; never on the plans below).

Prints predicted vs measured step time per case, the median |error| for torch's runtime
and pipesim's executor, and the ratio of pipesim's executor to torch's runtime.

    python experiments/validate_torch_runtime.py [--ranks 2,4] [--models mlp,gpt] [--quick]
Writes experiments/results/validate_torch_runtime.csv/.json, rows written as they come,
and each profile under experiments/results/validate_torch_runtime/ (to re-predict).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from executor.calibrate import calibrate_cpu
from executor.distributed import _free_port, spawn_plans
from executor.host_allocator import retain_freed_memory
from executor.models import builtin_job
from executor.partition import split_module
from executor.profiler import profile
from executor.torch_schedules import from_torch, to_torch_runtime
from experiments.common import RESULTS, machine, write_results
from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.schedule import Schedule, build_schedule
from pipesim.simulator import simulate
from pipesim.trace import metrics

MODELS: dict[str, dict] = {"mlp": dict(width=256, depth=7, in_features=256),
                           "gpt": dict(vocab=512, d_model=64, n_layers=6, n_heads=4, seq_len=32)}
BATCH = 32
#: (torch class or "pipesim:NAME", stages a rank)
CASES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
         ("ZBVZeroBubble", 2), ("DualPipeV", 2), ("pipesim:zb-h1", 1), ("pipesim:zbv", 2)]


def pipesim_schedule(case: str, n_ranks: int, v: int, m: int) -> Schedule:
    """The schedule of ``case`` as a pipesim Schedule (torch's order, or pipesim's own)."""
    if case.startswith("pipesim:"):
        name = case.split(":", 1)[1]
        return build_schedule(Plan([1] * (n_ranks * v), m, m, checkpoint="never", schedule=name,
                                   virtual_stages=v))
    return from_torch(case, n_ranks=n_ranks, n_microbatches=m, stages_per_rank=v, batch_size=m)


def _torch_schedule(case: str, stages: list, m: int, loss_fn, schedule: Schedule, csv_dir: str):
    """torch's schedule object for ``case`` over this rank's ``stages``."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    if case.startswith("pipesim:"):  # pipesim's order through torch's CSV, torch's runtime
        return to_torch_runtime(schedule, stages, loss_fn, scale_grads=False, csv_dir=csv_dir)
    cls = get_schedule_class(case)
    multi = issubclass(cls, PipelineScheduleMulti)
    return cls(stages if multi else stages[0], n_microbatches=m, loss_fn=loss_fn,
               scale_grads=False)


def _rank(rank: int, world: int, port: int, job, runs: list[tuple[str, list[int], Schedule]],
          iterations: int, warmup: int, csv_dir: str, out) -> None:
    """One process: every run's torch schedule, timed; results to ``out`` as they come."""
    from torch.distributed.pipelining import PipelineStage

    try:
        torch.set_num_threads(1)
        # the allocator policy pipesim's ranks and profiles run under: compared like for like
        retain_freed_memory()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=180))
        for index, (case, balance, schedule) in enumerate(runs):
            torch.manual_seed(0)
            module, loss_fn, x, y = job()
            parts = split_module(module, balance)
            n = len(parts)
            mine = [s for s in range(n) if schedule.placement[s] == rank]
            stages = [PipelineStage(parts[s], s, n, torch.device("cpu")) for s in mine]
            sched = _torch_schedule(case, stages, schedule.n_microbatches, loss_fn, schedule,
                                    csv_dir)
            walls = []
            for i in range(warmup + iterations):
                module.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                kwargs = {"target": y, "losses": []} if (n - 1) in mine else {}
                if 0 in mine:
                    sched.step(x, **kwargs)
                else:
                    sched.step(**kwargs)
                end = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(end, op=dist.ReduceOp.MAX)  # the latest rank's end
                if i >= warmup:
                    walls.append(float(end))
            if rank == 0:
                out.put(("ok", index, statistics.median(walls)))
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        out.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def run_torch(job, runs: list[tuple[str, list[int], Schedule]], world: int, iterations: int,
              warmup: int) -> list[float | str]:
    """Median step seconds of each run under torch's runtime (or its error, as text)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as csv_dir:
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, job, runs, iterations, warmup,
                                                 csv_dir, out), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: list[float | str] = ["not run"] * len(runs)
        got, deadline = 0, time.monotonic() + 120 + 60 * len(runs)
        while got < len(runs) and time.monotonic() < deadline:
            try:
                status, index, value = out.get(timeout=5)
            except Exception:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if status == "error":
                results = [r if isinstance(r, float) else f"rank {index}: {value}" for r in results]
                break
            results[index] = value
            got += 1
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def _tiny_job(width: int = 8, batch: int = BATCH, layers: int = 8):
    """A micro-benchmark model: tiny linear layers, whose step time is torch's overhead."""
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return module, nn.functional.mse_loss, torch.randn(batch, width), torch.randn(batch, width)


def fit_overhead(world: int, base: Cluster, m: int, iterations: int) -> tuple[float, float]:
    """Seconds torch's runtime spends per action, fitted so that pipesim predicts the
    tiny GPipe micro-benchmark's measured step; returns (overhead, measured step)."""
    job = functools.partial(_tiny_job, layers=world)
    module, loss_fn, x, y = job()
    prof = profile(module, (x, y), sorted({BATCH // m, BATCH}), loss_fn=loss_fn, repeats=5,
                   progress=False, checkpointed=False, split=False)
    schedule = pipesim_schedule("GPipe", world, 1, m)
    plan = Plan([1] * world, m, BATCH, checkpoint="never")
    measured = run_torch(job, [("GPipe", [1] * world, schedule)], world, iterations, 2)[0]
    if not isinstance(measured, float):
        raise RuntimeError(f"the micro-benchmark failed: {measured}")

    def predicted(overhead: float) -> float:
        cluster = dataclasses.replace(base, compute_overhead_s=overhead, action_gap_s=0.0,
                                      wakeup_gap_s=0.0)
        return metrics(simulate(prof, plan, cluster, schedule=schedule,
                                track_memory=False)).iteration_time_s

    lo, hi = 0.0, 0.05
    for _ in range(40):  # the step grows with the overhead: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 ranks, mlp, 3 iterations")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.models, args.iterations = "2", "mlp", 3
    m = args.microbatches
    rows: list[dict] = []
    meta: dict = {**machine(), "torch": torch.__version__, "batch": BATCH, "microbatches": m,
                  "models": {k: MODELS[k] for k in args.models.split(",")}, "calibration": {}}
    for world in (int(r) for r in args.ranks.split(",")):
        print(f"{world} ranks: calibrating ...", flush=True)
        base = calibrate_cpu(world)
        overhead, tiny = fit_overhead(world, base, m, args.iterations)
        # torch's runtime: its whole per-action cost fitted in the action, no gap of either kind
        torch_cluster = dataclasses.replace(base, compute_overhead_s=overhead, action_gap_s=0.0,
                                            wakeup_gap_s=0.0, name="torch_runtime_cpu")
        meta["calibration"][str(world)] = {"pipesim_executor": base.to_dict(),
                                           "torch_runtime": torch_cluster.to_dict(),
                                           "micro_benchmark_step_s": tiny}
        print(f"  torch's runtime: {overhead * 1e6:.0f} us an action (tiny GPipe step "
              f"{tiny * 1e3:.2f} ms); pipesim's executor: {base.compute_overhead_s * 1e6:.0f} us "
              f"+ {base.action_gap_s * 1e6:.0f} us", flush=True)
        for name in args.models.split(","):
            sizes = dict(MODELS[name])
            job = functools.partial(builtin_job, name, BATCH, **sizes)
            module, loss_fn, x, y = job()
            prof = profile(module, (x, y), sorted({BATCH // m, BATCH // 2, BATCH}),
                           loss_fn=loss_fn, repeats=5, progress=False, meta={"model": name})
            prof.save(RESULTS / "validate_torch_runtime" / f"profile_{world}ranks_{name}.csv")
            runs, plans = [], []
            for case, v in CASES:
                n_stages = world * v
                if n_stages > prof.n_layers:
                    continue
                balance = min_max_partition(prof.layer_times(BATCH // m), n_stages)
                try:
                    schedule = pipesim_schedule(case, world, v, m)
                except Exception as exc:  # a schedule torch refuses for this shape
                    print(f"  {case}: {exc}", flush=True)
                    continue
                runs.append((case, balance, schedule))
                plans.append(Plan(balance, m, BATCH, checkpoint="never",
                                  placement=schedule.placement))
            torch_steps = run_torch(job, runs, world, args.iterations, 2)
            ours = spawn_plans(job, plans, schedules=[s for _, _, s in runs],
                               iterations=args.iterations, warmup=2, track_memory=False)
            for (case, balance, schedule), plan, t_step, (result, _) in zip(
                    runs, plans, torch_steps, ours, strict=True):
                pred_torch = metrics(simulate(prof, plan, torch_cluster, schedule=schedule,
                                              track_memory=False)).iteration_time_s
                pred_ours = metrics(simulate(prof, plan, base, schedule=schedule,
                                             track_memory=False)).iteration_time_s
                # ablation: no limit on the ranks computing at once (no time slicing)
                unsliced = {label: 1e3 * metrics(simulate(
                    prof, plan, dataclasses.replace(c, host_cores=0), schedule=schedule,
                    track_memory=False)).iteration_time_s
                    for label, c in (("torch", torch_cluster), ("pipesim", base))}
                ours_s = metrics(result.trace).iteration_time_s
                row = {"model": name, "ranks": world, "schedule": case,
                       "balance": ",".join(map(str, balance)), "microbatches": m,
                       "torch_measured_ms": t_step * 1e3 if isinstance(t_step, float) else None,
                       "torch_predicted_ms": pred_torch * 1e3,
                       "pipesim_measured_ms": ours_s * 1e3, "pipesim_predicted_ms": pred_ours * 1e3,
                       "torch_predicted_ms_no_core_limit": unsliced["torch"],
                       "pipesim_predicted_ms_no_core_limit": unsliced["pipesim"],
                       "torch_error": None if isinstance(t_step, float) else t_step[:300]}
                if isinstance(t_step, float):
                    row["torch_error_pct"] = 100 * (pred_torch / t_step - 1)
                    row["pipesim_over_torch"] = ours_s / t_step
                row["pipesim_error_pct"] = 100 * (pred_ours / ours_s - 1)
                rows.append(row)
                print(f"  {name} {case:22s} torch {row['torch_measured_ms'] or float('nan'):8.2f} ms "
                      f"(pred {pred_torch * 1e3:8.2f})  pipesim {ours_s * 1e3:8.2f} ms "
                      f"(pred {pred_ours * 1e3:8.2f})", flush=True)
                write_results("validate_torch_runtime", pd.DataFrame(rows), meta)
    table = pd.DataFrame(rows)
    ok = table.dropna(subset=["torch_measured_ms"])
    summary: dict[str, object] = {
        "cases": len(table), "torch_runs_failed": int(table.torch_measured_ms.isna().sum()),
        "torch_median_abs_error_pct": float(ok.torch_error_pct.abs().median()),
        "torch_max_abs_error_pct": float(ok.torch_error_pct.abs().max()),
        "pipesim_median_abs_error_pct": float(table.pipesim_error_pct.abs().median()),
        "pipesim_max_abs_error_pct": float(table.pipesim_error_pct.abs().max()),
        "pipesim_over_torch_median": float(ok.pipesim_over_torch.median()),
    }
    for who in ("torch", "pipesim"):
        measured = ok[f"{who}_measured_ms"]
        err = (100 * (ok[f"{who}_predicted_ms_no_core_limit"] / measured - 1)).abs()
        summary[f"{who}_no_core_limit"] = {"median_abs_error_pct": float(err.median()),
                                           "max_abs_error_pct": float(err.max())}
    per = {}
    for (world, name), part in ok.groupby(["ranks", "model"]):
        per[f"{world} ranks {name}"] = {
            "torch_median_abs_error_pct": float(part.torch_error_pct.abs().median()),
            "pipesim_median_abs_error_pct": float(part.pipesim_error_pct.abs().median()),
            "pipesim_over_torch_median": float(part.pipesim_over_torch.median())}
    summary["per_ranks_and_model"] = per
    meta["summary"] = summary
    path = write_results("validate_torch_runtime", table, meta)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
