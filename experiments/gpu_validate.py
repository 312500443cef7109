"""Validation on a GPU: CUDA profiles, the in-process executor with every stage on one GPU.

Rerunnable by anyone with a CUDA GPU (and, with --device cpu --quick, anywhere):

1. profile the built-in models on the device in fp32 and bf16 at several micro-batch sizes;
   and measure each stage of the grid's balances in place, alone, plain and checkpointed
   at every size (executor.in_place.device_stage_costs: the executor's own code path,
   launches back to back, the checkpoint entered once): the costs the prediction gives
   its actions (pipesim.readings.InPlaceCost; ablation profile_costs: the profile's);
   the profile also times each pass beside each other pass, two threads on the device
   (``profile(..., pairs=True)``): the variant ``threads_pairs`` predicts with them
   (``Cluster.thread_pairs``);
2. calibrate the in-process executor's overheads on a tiny model (not the grid's plans);
3. run a grid (balanced/skewed balance, chunks 1..16, three checkpoint modes, GPipe and
   1F1B) with 2 and 4 stages as worker threads on ``cuda:0`` -- the simulator models
   them as one shared device -- and compare predicted against measured iteration time and
   peak allocated memory (``torch.cuda.max_memory_allocated``; the prediction adds the
   batch the caller put on the device, which the pipeline model does not own);
4. per stage: run each stage's action list alone on the GPU, its neighbours' tensors
   synthesised (executor.stage_alone), and compare max_memory_allocated and
   max_memory_reserved with the simulator's peak for that stage (stages on separate
   devices, so received buffers count; the stage's share of the batch added);
5. write CSV/JSON with the device name, torch and CUDA versions.

    python experiments/gpu_validate.py [--device cuda:0] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.calibrate import calibrate_threads, overheads_text
from executor.in_place import device_stage_costs
from executor.memory import tensor_bytes
from executor.models import builtin_job
from executor.pipeline import Pipeline
from executor.profiler import device_name, profile
from executor.stage_alone import run_stage_alone
from experiments.common import RESULTS, machine
from experiments.validation import grid, predict_and_measure, save_measured_actions, summarise
from pipesim.cluster import Cluster
from pipesim.costs import PlanCosts
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.readings import in_place_costs_of
from pipesim.simulator import simulate
from pipesim.trace import metrics

MODELS = {
    "gpt": dict(vocab=8192, d_model=1024, n_layers=8, n_heads=16, seq_len=256),
    "mlp": dict(width=4096, depth=8, in_features=4096),
}
QUICK = {"gpt": dict(vocab=256, d_model=32, n_layers=2, n_heads=2, seq_len=16),
         "mlp": dict(width=64, depth=3, in_features=64)}


def stage_memory(models: dict, args: argparse.Namespace, out: Path) -> pd.DataFrame:
    """Each stage alone: allocator peaks against the simulator's peak for that stage."""
    rows = []
    for dtype in args.dtypes.split(","):
        for name, model_sizes in models.items():
            module, loss_fn, x, y = builtin_job(name, args.batch, dtype=dtype, **model_sizes)
            prof = Profile.load(out / f"profile_{name}_{dtype}.csv")
            for plan in grid(prof, 2, args.batch, chunks=(4, 16), skew=False):
                cluster = Cluster.pcie_gpus(plan.n_devices)
                predicted = metrics(simulate(prof, plan, cluster)).peak_memory_bytes
                for s in range(plan.n_stages):
                    peak = run_stage_alone(module, plan, s, x, y, device=args.device,
                                           loss_fn=loss_fn)
                    # the CUDA allocator also holds the stage's share of the batch; the
                    # CPU tracker counts what the stage allocates, not its inputs
                    on_cuda = "allocated" in peak
                    batch = (tensor_bytes(x) if s == 0 else tensor_bytes(y)
                             if s == plan.n_stages - 1 else 0) if on_cuda else 0
                    pred = predicted[cluster.devices[s].resource] + batch
                    allocated = peak["allocated"] if on_cuda else peak["tracked"]
                    rows.append({"model": name, "dtype": dtype, "plan": plan.label(), "stage": s,
                                 "predicted_bytes": pred, "allocated_bytes": allocated,
                                 "reserved_bytes": peak.get("reserved"),
                                 "allocated_error_pct": 100 * (pred / allocated - 1)})
    table = pd.DataFrame(rows)
    table.to_csv(out / "stage_memory_gpu.csv", index=False)
    print("per-stage memory: median |error| vs allocated "
          f"{table.allocated_error_pct.abs().median():.1f}%", flush=True)
    return table


def in_place_rows(prof: Profile, name: str, dtype: str, model_sizes: dict, n_stages: int,
                  args: argparse.Namespace, out: Path) -> list[dict]:
    """Each stage of the grid's balances for ``prof`` (the built-in model ``name``)
    measured in place on the GPU, alone, plain and checkpointed at every size of the
    profile (:func:`executor.in_place.device_stage_costs`): the costs the prediction gives
    each action (:class:`pipesim.readings.InPlaceCost`).  Added to
    ``out/in_place_costs_gpu.json`` (``{"model/dtype/2st": rows, "_machine": ...}``) as
    each model is done."""
    t0 = time.time()
    job = functools.partial(builtin_job, name, args.batch, dtype=dtype, **model_sizes)
    balances = sorted({tuple(p.balance) for p in grid(prof, n_stages, args.batch)})
    rows = [row for balance in balances
            for row in device_stage_costs(job, balance, prof.micro_batch_sizes,
                                          device=args.device, rounds=args.in_place_rounds)]
    label = f"{name}/{dtype}/{n_stages}st"
    path = out / "in_place_costs_gpu.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    found[label] = rows
    found["_machine"] = {**machine(), "device_name": device_name(torch.device(args.device)),
                         "torch": torch.__version__}
    path.write_text(json.dumps(found, indent=1))
    print(f"in place {label}: {len(rows)} rows ({time.time() - t0:.0f} s)", flush=True)
    return rows


def measure_in_place(models: dict, args: argparse.Namespace, out: Path) -> None:
    """:func:`in_place_rows` for every model of a grid run already in ``out`` (its
    profiles)."""
    for n_stages in [int(s) for s in args.stages.split(",")]:
        for dtype in args.dtypes.split(","):
            for name, model_sizes in models.items():
                prof = Profile.load(out / f"profile_{name}_{dtype}.csv")
                in_place_rows(prof, name, dtype, model_sizes, n_stages, args, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations, at least")
    ap.add_argument("--min-seconds", type=float, default=0.5,
                    help="time each plan for at least this long (more iterations, at most 100)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "gpu"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--models", default="",
                    help="comma-separated subset of the built-in models (default: all; one a "
                         "call where a call's time is short, each into its own --out: a run "
                         "starts its folder's grid files afresh)")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--stage-memory-only", action="store_true",
                    help="only step 4, from the profiles a grid run left in --out")
    ap.add_argument("--no-stage-memory", action="store_true",
                    help="skip step 4 (about 80 s on an H200; --stage-memory-only later)")
    ap.add_argument("--in-place-rounds", type=int, default=10,
                    help="rounds of each stage's steps measured in place (medians)")
    ap.add_argument("--in-place-only", action="store_true",
                    help="only each stage's costs measured in place, from the profiles a "
                         "grid run left in --out (in_place_costs_gpu.json)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    models = QUICK if args.quick else MODELS
    if args.models:
        unknown = set(args.models.split(",")) - set(models)
        if unknown:
            ap.error(f"--models: unknown {sorted(unknown)}; the grid's are {sorted(models)}")
        models = {name: models[name] for name in args.models.split(",")}
    if args.stage_memory_only:
        stage_memory(models, args, out)
        return
    if args.in_place_only:
        measure_in_place(models, args, out)
        return
    env = {**machine(), "device": args.device, "device_name": device_name(dev),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    print(json.dumps(env), flush=True)
    t_start = time.time()
    (out / "validation_gpu_actions.csv.gz").unlink(missing_ok=True)
    tables = []
    speedups: dict[str, dict] = {}
    sizes = sorted({max(1, args.batch // c) for c in (1, 2, 4, 8, 16)})
    for n_stages in [int(s) for s in args.stages.split(",")]:
        cluster = calibrate_threads(args.device, n_stages)
        cluster.save(out / f"calibration_{n_stages}stages.json")
        print(f"{n_stages} stages: {overheads_text(cluster)}", flush=True)
        for dtype in args.dtypes.split(","):
            for name, model_sizes in models.items():
                module, loss_fn, x, y = builtin_job(name, args.batch, dtype=dtype, **model_sizes)
                # the concurrency law of streams sharing the device, measured at each size
                # (streams=...): the prediction uses it; the law the profile's size scaling
                # implies is written beside it for comparison
                prof = profile(module, (x, y), sizes, args.device, loss_fn=loss_fn, repeats=10,
                               warmup=3, progress=False, streams=n_stages, interpreter=True,
                               pairs=True, meta={"model": name})
                prof.save(out / f"profile_{name}_{dtype}.csv")
                # each stage of the grid measured in place, alone: the costs the
                # prediction gives its actions (the profile's: ablation profile_costs)
                label = f"{name}/{dtype}/{n_stages}st"
                rows = in_place_rows(prof, name, dtype, model_sizes, n_stages, args, out)
                placed = dataclasses.replace(cluster, in_place_costs=in_place_costs_of(rows))
                scaling = dict(prof.meta)
                scaling.pop("stream_speedup")  # (the interpreter shares: data for now)
                laws = {str(b): {"measured": prof.stream_speedup(b),
                                 "from_profile": PlanCosts(
                                     Profile(prof.table, scaling),
                                     Plan([len(module)], max(1, args.batch // b), args.batch)
                                 ).device_speedup(n_stages)}
                        for b in sizes}
                speedups[f"{name}/{dtype}/{n_stages}st"] = laws
                (out / "device_speedup.json").write_text(json.dumps(speedups, indent=1))
                print(f"device speedup {name}/{dtype}: {laws}", flush=True)
                plans = grid(prof, n_stages, args.batch,
                             chunks=(1, 4, 16) if args.quick else (1, 2, 4, 8, 16))
                batch_bytes = tensor_bytes(x) + tensor_bytes(y)

                def measure(ps, module=module, loss_fn=loss_fn, x=x, y=y, n_stages=n_stages,
                            name=name, dtype=dtype, prof=prof, cluster=placed):
                    traces = []
                    for p in ps:
                        # one pipeline at a time, its memory freed before the next plan:
                        # peaks are the run's own (see executor.cuda_peaks)
                        # the allocator's own history for one plan a grid (memory_viz)
                        snap = (out / "snapshots" / f"{name}_{dtype}_{n_stages}st_"
                                f"{p.schedule}_m{p.chunks}_{p.checkpoint}.pickle"
                                if dev.type == "cuda" and p.chunks == 4 and
                                p.checkpoint == "always" else None)
                        # enough iterations to time at least --min-seconds of the plan
                        # (two runs of one schedule differed by 12-15% median on mlp with 5)
                        guess = metrics(simulate(prof, p, cluster, track_memory=False))
                        its = int(min(100, max(args.iterations, math.ceil(
                            args.min_seconds / max(guess.iteration_time_s, 1e-6)))))
                        with Pipeline(module, p, devices=[args.device] * n_stages,
                                      loss_fn=loss_fn) as pipe:
                            traces.append(pipe.run(x, y, iterations=its,
                                                   warmup=2, memory_snapshot=snap).trace)
                        module.zero_grad(set_to_none=True)
                        del pipe
                        gc.collect()
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                    return traces

                # ablations: the same plans with the profile's costs; under the law the
                # size scaling implies (the device alone); and that law with the workers
                # as threads of one process, holding its interpreter for their forwards'
                # measured shares and slowdowns and issuing their backwards in turn on
                # autograd's one thread for the GPU (the host's part the measured law
                # folds in, modelled action by action)
                threads = dataclasses.replace(placed, devices=[
                    dataclasses.replace(d, process="workers") for d in placed.devices])
                # (and that without the checkpoint's hooks holding the interpreter on
                # autograd's thread, measured beside another thread's forwards; and with
                # each worker's host going on once it has issued an action, its gaps
                # hidden behind device-bound work: Cluster.issue_ahead)
                no_hooks = {k: v for k, v in scaling.items() if k != "engine_interpreter_share"}
                table, traces = predict_and_measure(
                    prof, plans, placed, measure, label,
                    {"profile_costs": (prof, cluster),
                     "scaling_law": (Profile(prof.table, scaling), placed),
                     "threads_interpreter": (Profile(prof.table, scaling), threads),
                     "threads_no_hooks": (Profile(prof.table, no_hooks), threads),
                     # (and a recomputation taking turns on autograd's thread with the
                     # other backwards' nodes, not that thread to itself: the ablation of
                     # Cluster.recompute_holds_engine)
                     "threads_recompute_turns": (Profile(prof.table, scaling), dataclasses.replace(
                         threads, recompute_holds_engine=False)),
                     "threads_issue_ahead": (Profile(prof.table, scaling),
                                             dataclasses.replace(threads, issue_ahead=True)),
                     # (and the executor's gaps between actions holding the interpreter:
                     # Cluster.gaps_hold_interpreter, opt-in: a what-if here)
                     "threads_gaps": (Profile(prof.table, scaling),
                                      dataclasses.replace(threads, gaps_hold_interpreter=True)),
                     # each pass slowed by the pass beside it, as the profile measured the
                     # pairs (in place of the interpreter's, engine's and device's turns:
                     # Cluster.thread_pairs)
                     "threads_pairs": (prof, dataclasses.replace(threads, thread_pairs=True))})
                save_measured_actions(out / "validation_gpu_actions.csv.gz", label, plans, traces)
                table["peak_pred_bytes"] += batch_bytes
                table["stages"] = n_stages
                table["dtype"] = dtype
                tables.append(table)
                # written as the run goes: a run cut short keeps every finished grid
                pd.concat(tables, ignore_index=True).to_csv(out / "validation_gpu.csv", index=False)
                s = summarise(table)
                print(f"{label}: median |err| {s['median_abs_error_pct']:.1f}% max "
                      f"{s['max_abs_error_pct']:.1f}% memory "
                      f"{s.get('median_abs_memory_error_pct', float('nan')):.1f}% "
                      f"spearman {s['spearman_throughput']:.3f} "
                      f"({time.time() - t_start:.0f} s)", flush=True)
    table = pd.concat(tables, ignore_index=True)
    table.to_csv(out / "validation_gpu.csv", index=False)
    if not args.no_stage_memory:
        stage_memory(models, args, out)
    per_grid = {label: summarise(part) for label, part in table.groupby("model")}
    (out / "validation_gpu.json").write_text(json.dumps({"env": env, "per_grid": per_grid,
                                                         "overall": summarise(table)}, indent=2))
    print(json.dumps(per_grid, indent=1))


if __name__ == "__main__":
    main()
