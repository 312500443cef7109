"""Stages as threads of one process (the in-process executor) on this machine's CPU.

The threads share one interpreter: a forward is Python issuing operations and holds it,
a backward runs mostly in autograd's engine.  This grid checks the simulator's
interpreter (``Device.process``, the profile's measured ``interpreter_share``) where it
can be checked without a GPU:

1. profile each model (one torch thread) with the interpreter shares measured at every
   size (two threads against one: ``executor.profiler.measure_interpreter_share``), and
   each pass beside each other pass (``measure_pair_slowdown``: the variant ``pairs``,
   ``Cluster.thread_pairs``, predicts with those instead);
2. measure the executor's overheads between and inside actions (``measure_thread_overhead``),
   and in place, in this process as ``validate.py`` measures them in its ranks: each
   stage's steps at once (``device_stage_costs``), what a wait costs the actions after
   it (the in-process ``executor.in_place.idle_costs``, read against the profile) and
   what checkpointing adds to a backward (from the stage costs), both read before and
   after the grid, the mean (``idle_before``: the idle costs' reading before alone);
3. run a grid (2 stages, chunks 1..16, GPipe and 1F1B, never / always) through
   ``executor.pipeline.Pipeline`` (threads, one core each), read the overheads again, and
   predict it with the mean of the readings before and after it (``unbracketed``: the one
   before alone), the idle costs and the checkpoint's extras (ablations
   ``no_idle_costs``, ``no_checkpoint_extras``, ``no_in_place``: the prediction before
   2026-11-26 23:30), the workers as threads of one process, and without
   (``no_interpreter``): median / max |error|; and with each stage's actions at their
   seconds at once in place of the profile's (``in_place_costs``, ``in_place_pairs``,
   what took the H200 grid from 7.3% to 4.9%).

With ``--cores 1`` every thread of the process runs on one core (``executor.cores``): the
calibration, the profile and the grid, predicted by the cluster of threads taking turns on
that core (``Cluster.cpu_threads(2, cores=1)``, which ``calibrate_threads`` gives a
process on one core).  There no hand-over of the interpreter crosses cores.

    python experiments/validate_threads.py [--models gpt,mlp] [--iterations 10] [--cores 1]
    python experiments/validate_threads.py --repredict [--cores 1]  # saved run, today's model
Writes experiments/results/validation_TAG.csv/.json (TAG ``threads``, with ``--cores N``
``threads_Ncore``), and for ``--repredict`` the run's calibration (``calibration_TAG.json``),
profiles (``profile_TAG_MODEL.csv``), in-place costs (``in_place_costs_TAG.json``) and
measured actions (``validation_TAG_actions.csv.gz``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.calibrate import calibrate_threads, measure_thread_overhead, overheads_text
from executor.cores import first_cores, threads_on
from executor.in_place import checkpoint_extras_of, device_stage_costs, idle_costs
from executor.models import builtin_job
from executor.pipeline import Pipeline
from executor.profiler import profile
from experiments.common import RESULTS, machine, write_results
from experiments.validation import (
    bracketed,
    in_passes,
    iterations_for,
    mean_readings,
    pass_noise,
    predict_saved,
    predicted_against,
    save_measured_actions,
    summarise,
)
from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.costs import with_profile_seconds
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.readings import in_place_costs_of

#: small models: per-operation overhead is much of their time, as on a GPU's launch-bound
#: layers
MODELS = {"gpt": dict(vocab=256, d_model=32, n_layers=8, n_heads=2, seq_len=8),
          "mlp": dict(width=64, depth=8, in_features=64)}
BATCH = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--iterations", type=int, default=10,
                    help="iterations a plan is measured at least, each pass")
    ap.add_argument("--min-seconds", type=float, default=0.3,
                    help="seconds a plan is measured at least, each pass")
    ap.add_argument("--passes", type=int, default=2,
                    help="runs of the whole grid, order reversed every other pass")
    ap.add_argument("--tie-break", type=float, default=0.15, metavar="FRACTION",
                    help="one pass more for a plan whose passes lie further apart (0: none)")
    ap.add_argument("--cores", type=int, default=None,
                    help="run every thread of this process on its first N cores (default: "
                    "where the operating system puts them); results tagged threads_Ncore")
    ap.add_argument("--repredict", action="store_true",
                    help="predict the saved run again with today's model, measuring nothing")
    args = ap.parse_args()
    tag = "threads" if args.cores is None else f"threads_{args.cores}core"
    if args.repredict:
        repredict(tag)
        return
    torch.set_num_threads(1)
    with threads_on(first_cores(args.cores)):
        run(args, tag)


def run(args: argparse.Namespace, tag: str) -> None:
    """Calibrate, profile, measure and predict the grid (see the module docstring)."""
    # kept for --repredict: the run's calibration, each model's profile, every measured
    # action (a model change re-predicts the same measurements)
    actions_path = RESULTS / f"validation_{tag}_actions.csv.gz"
    actions_path.unlink(missing_ok=True)
    # as gpu_validate.py calibrates the GPU's threads (on a tiny 1F1B pipeline: its
    # overheads hold some of the interpreter's turns too, a little counted twice)
    cluster = calibrate_threads("cpu", 2)
    print(overheads_text(cluster), flush=True)
    cluster.save(RESULTS / f"calibration_{tag}.json")
    # the overheads read again after each model's grid, each model predicted with the
    # mean of the readings before and after it, as validate.py brackets the processes'
    # (one reading, a median of three, ranged 0.017-0.190 ms an action over three runs
    # and 0.023-0.276 within ten minutes, 2026-11-26): (action gap, wake-up gap, all) and
    # the in-action overhead, seconds, in validate.py's layout (predict_saved reads them)
    gaps: list[tuple] = [(cluster.action_gap_s, cluster.wakeup_gap_s, None)]
    in_action = [cluster.compute_overhead_s]
    in_place: dict[str, list[dict]] = {}  # model -> rows of device_stage_costs
    idle: dict[str, list[dict]] = {}  # model -> IdleCost rows, read against its profile
    extras: dict[str, list[dict]] = {}  # model -> CheckpointExtra rows (before/after mean)
    tables, measured_all = [], []
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        module, loss_fn, x, y = job()
        sizes = sorted({BATCH // c for c in (1, 2, 4, 8, 16)})
        prof = profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=7, warmup=2,
                       progress=False, interpreter=True, pairs=True, meta={"model": name})
        print(f"{name}: interpreter shares {prof.meta['interpreter_share']}", flush=True)
        prof.save(RESULTS / f"profile_{tag}_{name}.csv")
        balance = min_max_partition(prof.layer_times(BATCH // 4), 2)
        # each stage measured in place through the executor's StageRunner, plain and
        # checkpointed at every size (device_stage_costs, as gpu_validate.py measures the
        # GPU's stages): the variant in_place_costs gives the actions these seconds in
        # place of the profile's sum and the in-action overhead
        in_place[name] = device_stage_costs(job, balance, sizes, device="cpu")
        (RESULTS / f"in_place_costs_{tag}.json").write_text(json.dumps(in_place, indent=1))
        # what a wait costs the action after it, in place: each stage's steps in this
        # process after it slept before its forward or backward, against at once (a worker
        # blocked on its queue sleeps as a rank does; the in-process idle_costs)
        waited = idle_costs(job, balance, sizes, device="cpu")
        plans = [Plan(balance, m, BATCH, checkpoint=ckpt, schedule=schedule)
                 for schedule in ("gpipe", "1f1b") for ckpt in ("never", "always")
                 for m in (1, 2, 4, 8, 16)]

        # each plan for at least --min-seconds a pass (by its predicted iteration), over
        # --passes passes in alternating order (validation.in_passes): one pass of ten
        # iterations read GPipe and 1F1B at one micro-batch -- the same actions -- 8.7
        # and 14.1 ms apart (gpt, 2026-11-26), a noise floor of 20% median
        counts = {p.label(): iterations_for(prof, p, cluster, args.iterations,
                                            args.min_seconds) for p in plans}

        def measure_once(ps, module=module, loss_fn=loss_fn, x=x, y=y, counts=counts):
            traces = []
            for p in ps:
                with Pipeline(module, p, loss_fn=loss_fn, track_memory=False) as pipe:
                    traces.append(pipe.run(x, y, iterations=counts[p.label()],
                                           warmup=2).trace)
                module.zero_grad(set_to_none=True)
            return traces

        measure = in_passes(measure_once, args.passes, args.tie_break or None)
        measured = measure(plans)
        again = measure_thread_overhead("cpu", 2)
        gaps.append((again["between_actions_s"], again["wakeup_s"],
                     again["between_actions_all_s"]))
        in_action.append(again["in_action_s"])
        read = bracketed(cluster, [cluster.host_contention], gaps[-2:], in_action[-2:])
        # what a wait costs, read against the profile (its regime against the stage's
        # steps at once, measured in place minutes after it), and the checkpoint's extras,
        # each the mean of a reading before and after the grid (this VM's pace moves by up
        # to 2x within ten minutes): the default since 2026-11-26 23:30, six runs 14.8-29.8%
        # -> 7.9-19.9% median, most of it the steps at once, the waits' own surcharge
        # within a point or two (experiments/README.md)
        waited_after = idle_costs(job, balance, sizes, device="cpu")
        waits = with_profile_seconds(mean_readings(waited, waited_after), prof, read, balance)
        added = mean_readings(checkpoint_extras_of(in_place[name]), checkpoint_extras_of(
            device_stage_costs(job, balance, sizes, device="cpu")))
        idle[name] = [dataclasses.asdict(row) for row in waits]
        extras[name] = [dataclasses.asdict(row) for row in added]
        model_cluster = dataclasses.replace(read, idle_costs=tuple(waits),
                                            checkpoint_extras=tuple(added))
        print(f"{name}: {overheads_text(model_cluster)} (readings before and after its "
              "grid, the mean)", flush=True)
        apart = dataclasses.replace(model_cluster, devices=[
            dataclasses.replace(d, process="") for d in model_cluster.devices])

        # mechanisms out: the interpreter; the checkpointed shares and all slowdowns; the slowdowns
        plain = {b: {k: g for k, g in v.items() if k in ("F", "B")}
                 for b, v in prof.meta["interpreter_share"].items()}
        no_ckpt_share = Profile(prof.table, {**prof.meta, "interpreter_share": plain,
                                             "interpreter_slowdown": {}})
        no_slowdown = Profile(prof.table, {**prof.meta, "interpreter_slowdown": {}})
        # (the cluster, cpu-threads, shares by the interpreter's measured shares; the
        # variant pairs by each pass measured beside each other pass: Cluster.thread_pairs)
        pairs = dataclasses.replace(model_cluster, thread_pairs=True)
        # each stage's actions at their seconds measured in place, in place of the
        # profile's (and so of the idle costs' reading against it)
        costs = in_place_costs_of(in_place[name])
        placed = dataclasses.replace(read, in_place_costs=costs)
        variants = {"no_interpreter": (prof, apart),
                    # without the checkpointed shares and slowdowns; without the slowdowns
                    "no_ckpt_share": (no_ckpt_share, model_cluster),
                    "no_slowdown": (no_slowdown, model_cluster),
                    "pairs": (prof, pairs),
                    # the executor's gaps between actions holding the interpreter, in turn
                    # or, by the pairs, as forwards (Cluster.gaps_hold_interpreter: opt-in)
                    "gaps_held": (prof, dataclasses.replace(model_cluster,
                                                            gaps_hold_interpreter=True)),
                    "pairs_gaps_held": (prof, dataclasses.replace(pairs,
                                                                  gaps_hold_interpreter=True)),
                    "in_place_costs": (prof, placed),
                    "in_place_pairs": (prof, dataclasses.replace(placed, thread_pairs=True)),
                    # without what a wait costs, without the checkpoint's extras, without
                    # both (the prediction before 2026-11-26 23:30)
                    "no_idle_costs": (prof, dataclasses.replace(model_cluster, idle_costs=())),
                    "no_checkpoint_extras": (prof, dataclasses.replace(
                        model_cluster, checkpoint_extras=())),
                    "no_in_place": (prof, read),
                    # the idle costs read before the grid alone
                    "idle_before": (prof, dataclasses.replace(
                        model_cluster, idle_costs=tuple(with_profile_seconds(
                            waited, prof, read, balance)))),
                    # the overheads of the reading before the grid alone
                    "unbracketed": (prof, dataclasses.replace(
                        bracketed(cluster, [cluster.host_contention], gaps[-2:-1],
                                  in_action[-2:-1]),
                        idle_costs=tuple(waits), checkpoint_extras=tuple(added)))}
        table = predicted_against(prof, plans, model_cluster, measured, name, variants)
        save_measured_actions(actions_path, name, plans, measured)
        tables.append(table)
        measured_all += measured
        print(table[["balance", "chunks", "checkpoint", "schedule", "predicted_ms",
                     "predicted_ms_no_interpreter", "measured_ms", "error_pct"]]
              .round(2).to_string(index=False), flush=True)
    table = pd.concat(tables, ignore_index=True)
    summary = summarise(table)  # with every ablation's errors
    noise = pass_noise(measured_all)  # the same plan in two passes, minutes apart
    if noise is not None:
        summary["noise_floor_passes_median_pct"], summary["noise_floor_passes_max_pct"] = noise
        print(f"pass noise: {noise[0]:.1f}% median, {noise[1]:.1f}% max")
    for name, what in (("no_ckpt_share", "with the plain passes' shares alone (no Fc, Bc, "
                                         "no slowdown)"),
                       ("no_slowdown", "without the contended slowdown (plain turns)"),
                       ("pairs", "with the passes' measured pairs in place of the shares"),
                       ("gaps_held", "with the executor's gaps holding the interpreter"),
                       ("pairs_gaps_held", "with the pairs, the gaps taken as forwards"),
                       ("unbracketed", "with the overheads read before each grid alone"),
                       ("in_place_costs", "with each stage's costs measured in place"),
                       ("in_place_pairs", "with the in-place costs and the pairs"),
                       ("no_idle_costs", "without what a wait costs"),
                       ("no_checkpoint_extras", "without the checkpoint's extras"),
                       ("no_in_place", "without either (the prediction before 23:30)"),
                       ("idle_before", "with the idle costs read before the grid alone")):
        out = summary[f"ablation_{name}"]
        print(f"{what}: {out['median_abs_error_pct']:.1f}% / {out['max_abs_error_pct']:.1f}%")
    err = summary["ablation_no_interpreter"]
    for model, part in table.groupby("model"):
        with_ = (100 * (part.predicted_ms / part.measured_ms - 1)).abs()
        without = (100 * (part.predicted_ms_no_interpreter / part.measured_ms - 1)).abs()
        print(f"{model}: median |error| {with_.median():.1f}% (max {with_.max():.1f}%), "
              f"without the interpreter {without.median():.1f}% (max {without.max():.1f}%)")
    print(f"all: {summary['median_abs_error_pct']:.1f}% / {summary['max_abs_error_pct']:.1f}%, "
          f"without the interpreter {err['median_abs_error_pct']:.1f}% / "
          f"{err['max_abs_error_pct']:.1f}%")
    summary["gap_readings"] = gaps
    summary["in_action_readings"] = in_action  # seconds
    # (where validate.py keeps its own: --repredict and grid_history read them)
    summary["idle_costs"] = idle
    summary["checkpoint_extras"] = extras
    write_results(f"validation_{tag}", table, {**machine(), "summary": summary,
                                                "cluster": cluster.to_dict(),
                                                "models": MODELS, "torch": torch.__version__,
                                                "cores": args.cores})


def repredict(tag: str = "threads") -> None:
    """The saved run (``results/validation_TAG.csv`` with its calibration and profiles)
    predicted by today's model: ``results/validation_TAG_repredicted.csv`` and each
    model's median / max |error| beside the run's own."""
    # (the run's measurements with today's model: the choices the saved cluster carries,
    # whether the gaps hold the interpreter and whether the threads share by the measured
    # pairs, are today's defaults')
    today = Cluster.cpu_threads(2)
    table = predict_saved(RESULTS, tag,
                          cluster_fields={"gaps_hold_interpreter": today.gaps_hold_interpreter,
                                          "thread_pairs": today.thread_pairs})
    table["error_now_pct"] = 100 * (table.predicted_ms_now / table.measured_ms - 1)
    table.to_csv(RESULTS / f"validation_{tag}_repredicted.csv", index=False)
    for model, part in [*table.groupby("model"), ("all", table)]:
        print(f"{model}: as run {part.error_pct.abs().median():.1f}% / "
              f"{part.error_pct.abs().max():.1f}%, today "
              f"{part.error_now_pct.abs().median():.1f}% / {part.error_now_pct.abs().max():.1f}%")


if __name__ == "__main__":
    main()
