"""Prediction against measurement on this machine's CPU: multi-process executor, 2 stages.

1. calibrate links and executor overhead (executor.calibrate; never the plans below);
2. profile each built-in model offline, one thread, at every micro-batch size used, and
   measure in place what a wait costs each balance's actions (``executor.in_place.idle_costs``,
   ``--no-idle-costs`` to skip; the ablation ``no_idle_costs`` predicts without) and how
   much its stages slow each other computing at once (``executor.in_place.stage_contention``,
   the larger of it and the host law binding; the ablation ``no_in_place_contention``
   predicts with the law alone);
3. run a grid (balanced and skewed balance, chunks 1..16, three checkpoint modes, GPipe
   and 1F1B) through ``executor.distributed`` (2 processes x 1 thread, each on its own
   core unless ``--no-pin``; the calibration's processes alike) and simulate it;
4. print median/max |error| of iteration time, bubble error, Spearman rank correlation
   of throughput, the tuner's regret (in the grid, and confirmed: the best-predicted and
   the best-measured plan re-run side by side, :func:`experiments.validation.confirm_choice`),
   the replay check, and the error left with each action at the cost it had alone in the
   run (``alone_costs_*``: what of the error is the model's sharing rather than its costs,
   :func:`experiments.validation.with_alone_costs`).

    python experiments/validate.py [--models mlp,gpt] [--iterations 3] [--quick] [--no-pin]
                                   [--stages 4 --idle-at-once] [--lean]
Writes experiments/results/validation_cpu.csv/.json, calibration_cpu.json and figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch

from executor.calibrate import calibrate_cpu, host_contention, measure_overhead
from executor.distributed import spawn_plans
from executor.in_place import (
    checkpoint_extras_of,
    executor_gaps_of,
    idle_costs,
    run_on_costs,
    stage_contention_readings,
    stage_costs,
)
from executor.models import builtin_job
from executor.profiler import profile
from experiments.common import RESULTS, PhaseClock, machine, write_results
from experiments.validation import (
    CHECKPOINT_COSTS,
    bracketed,
    confirm_choice,
    drift_tracked,
    grid,
    in_passes,
    iterations_for,
    mean_readings,
    measured_table,
    noise_floor,
    paired,
    pass_noise,
    per_model_figures,
    predict_saved,
    predicted_against,
    profile_drift,
    replay_error,
    save_measured_actions,
    summarise,
    without_columns,
)
from pipesim.costs import with_profile_seconds
from pipesim.plot import scatter_predicted_measured
from pipesim.profile import Profile
from pipesim.readings import (
    IDLE_KINDS,
    CheckpointExtra,
    ExecutorGap,
    InPlaceCost,
    in_place_costs_of,
    median_slowdowns,
)

MODELS = {"mlp": dict(width=512, depth=7, in_features=512),
          "gpt": dict(vocab=1024, d_model=128, n_layers=4, n_heads=4, seq_len=32),
          "unet": dict(depth=2, width=16, image_size=32)}
BATCH = 32
#: steps per phase of the sustained host-contention ablation (see host_contention)
SUSTAINED_STEPS = 200
#: rounds of the idle costs measured in place per balance (``--idle-costs``, the default)
#: (``executor.in_place.idle_costs`` at 3 of the sizes after 3 idles, its default since
#: 2026-11-26: 1-1.5 minutes a balance of GPT or U-Net, half a minute of MLP)
IDLE_ROUNDS = 10
#: seconds of iterations a plan is measured at least, each pass: on this 2-core VM one
#: iteration of a short plan (MLP, ~10 ms) varies by 8% (CV) against 2-3% for GPT and U-Net
#: (~50-150 ms), so the three iterations that suit those leave a short plan's median noisy
MIN_SECONDS = 0.25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--iterations", type=int, default=3,
                    help="iterations a plan is measured at least, each pass")
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS,
                    help="seconds a plan is measured at least, each pass: a short plan gets "
                    "more iterations (from its predicted iteration time)")
    # four since 2026-11-29 (two before), with a profile between passes: the profiles, a
    # few seconds each, are what reads a shared machine's speed worst (one of five 62%
    # slow); the 70th-72nd grids, with five, 6.26%, 8.26% and 6.42% median, with the two
    # end profiles alone 12.35%, 10.22% and 8.08%.  Four passes alone changed nothing (the
    # 68th and 69th grids 6.58% and 8.42%, their first two passes alone 9.70% and 6.89%)
    ap.add_argument("--passes", type=int, default=4,
                    help="runs of the whole grid (order reversed every other pass), each "
                    "plan's iterations joined: the load of one moment weighs less")
    ap.add_argument("--tie-break", type=float, default=0.15, metavar="FRACTION",
                    help="one pass more for a plan whose passes lie further apart than this "
                    "(default 0.15: 3x the usual pass noise; 0: none; see in_passes)")
    ap.add_argument("--profile-between", action=argparse.BooleanOptionalAction, default=True,
                    help="profile the model again between passes too, and predict with the "
                    "mean of every profile (default; the ablation profile_ends: the one "
                    "before and the one after the grid alone, as before 2026-11-29)")
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    ap.add_argument("--stages", type=int, default=2, help="stages = processes")
    # pinned by default: five pinned grids on 2026-11-24 scattered 5.7% around each plan's
    # pooled error (median over plans, grid_history.py) where unpinned runs of the same
    # day gave 11.5-15.9%; unpinned, messages of some iterations land 2-5 ms late
    # (executor.distributed.rank_cores, experiments/executor_options.py)
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="each rank on its own cores, in the calibration too (default; "
                    "--no-pin leaves placement to the operating system)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    # the prediction's since 2026-11-25 night: four grids that measured them as an
    # ablation in their own hour went 11.1 -> 8.4%, 9.7 -> 9.3%, 7.4 -> 8.3% and 9.5 ->
    # 6.5% median, pooled 8.3% / 28.5% -> 6.0% / 24.3% (grid_history.py --git 4 --repredict:
    # predicted_ms_now against --idle none); the first grid predicted with them, 8.7 ->
    # 9.8% (five pooled 5.9% / 26.6% -> 4.9% / 20.4%)
    ap.add_argument("--idle-costs", action=argparse.BooleanOptionalAction, default=True,
                    help="measure each balance's idle costs in place and predict with them "
                    "(default; about 5 more minutes a reading, see --idle-repeats; the "
                    "ablation no_idle_costs predicts without; --no-idle-costs neither "
                    "measures nor uses them)")
    ap.add_argument("--after-wait", action="store_true",
                    help="with the idle costs, also measure a forward right after a backward "
                    "that waited (their kind FB; about 3 more minutes; the ablation "
                    "no_after_wait predicts without): the 98th-100th grids' protocol, which "
                    "moved their median by 0.03 points at most")
    # (the 16-core H200 host's 4-rank grid, 2026-11-26, without them: actions after 3-30 ms
    # idle ran 1.2-1.4x their profile, hot ones 0.97-1.04x; its error was all under)
    # (not by default: charged on top of today's model they moved the 111 grids pooled
    # 1.65% -> 1.83%, MLP 2.10% -> 2.64%, with readings of 2026-11-30; pipesim/MODEL.md)
    ap.add_argument("--run-on", action="store_true",
                    help="also measure each balance's run-on costs in place (a forward after "
                    "a forward, a backward after a backward, against the other order: "
                    "pipesim.readings.RunOnCost; about 20-45 s a balance) and predict with "
                    "them as the ablation run_on")
    ap.add_argument("--checkpoint-extras", action=argparse.BooleanOptionalAction, default=True,
                    help="measure what checkpointing adds to each stage's backward in place "
                    "and predict with it (pipesim.readings.CheckpointExtra; ablation "
                    "no_checkpoint_extras)")
    ap.add_argument("--executor-gaps", action=argparse.BooleanOptionalAction, default=True,
                    help="measure each stage's own executor seconds between actions in place "
                    "and predict with them (pipesim.readings.ExecutorGap; ablation "
                    "no_executor_gaps)")
    ap.add_argument("--idle-at-once", action="store_true",
                    help="measure the idle costs on every rank at the same time (a core per "
                    "rank and more: stages times faster; see executor.in_place.idle_costs)")
    # (one reading in three reads a whole layout high in a slow spell: the 45 grids of
    # 2026-11-29/30 re-predicted with single readings 1.74-2.02% median, max 7.0-23.7%,
    # with medians of three 1.74-2.03%, max 6.8-10.3%; experiments/README.md, session 54)
    ap.add_argument("--contention-repeats", type=int, default=3, metavar="N",
                    help="readings of each balance's in-place contention, the prediction's "
                    "the median (executor.in_place.stage_contention; 20-40 s a reading "
                    "of a model's balances)")
    # (one idle-cost reading per grid: over the 40 grids to the 132nd, pooled, the costs
    # took bias out, 1.76% / 12.4% -> 1.63% / 8.2%, but one grid alone read a lower median
    # without them in 23 of 40 -- the pattern the contention's median of three mended;
    # the ablations idle_reading_N predict with each reading alone, side by side)
    ap.add_argument("--idle-repeats", type=int, default=3, metavar="N",
                    help="readings of each balance's idle costs, the prediction's the median "
                    "(executor.in_place.idle_costs; 45-160 s a reading of a model's "
                    "balances; the ablations idle_reading_1.. predict with each alone)")
    ap.add_argument("--lean", action="store_true",
                    help="only what the prediction itself needs: no ablation-only readings "
                    "(the model's own, the in-place, the sustained and the old protocol's "
                    "host contention) and no "
                    "confirmed choice -- a fifth or so of a 4-rank run, for a lent machine's "
                    "10-minute calls; those ablations are then absent from the summary")
    ap.add_argument("--subdir", default="", help="results sub-folder (e.g. gpu for that machine)")
    ap.add_argument("--order", choices=("grid", "paired"), default="grid",
                    help="the order plans are measured in: as the grid builds them (every "
                         "GPipe plan first), or each plan's schedules side by side "
                         "(validation.paired: a host's drift over minutes then reads as noise)")
    ap.add_argument("--schedules", default="gpipe,1f1b",
                    help="comma-separated schedules of the grid (e.g. zb-h1,zbv)")
    ap.add_argument("--tag", default="", help="suffix of the results' names")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: predict the saved grid again from its saved profiles and "
                    "calibration (after a model change), and print before / after")
    args = ap.parse_args()
    for flag, repeats in (("--contention-repeats", args.contention_repeats),
                          ("--idle-repeats", args.idle_repeats)):
        if repeats < 1:  # (else it fails after minutes of calibration)
            ap.error(f"{flag} must be >= 1, got {repeats}")
    torch.set_num_threads(args.threads)
    results = RESULTS / args.subdir if args.subdir else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    tag = f"cpu_{args.stages}stages" if args.stages != 2 or args.subdir else "cpu"
    tag += f"_{args.tag}" if args.tag else ""
    if args.repredict:
        repredict(results, tag)
        return
    print("calibrating ...", flush=True)
    clock = PhaseClock()  # where the run's time goes (summary "phase_seconds")
    overheads: dict[str, Any] = {}
    cluster = calibrate_cpu(args.stages, overheads=overheads, pin_cores=args.pin)
    cluster.save(results / f"calibration_{tag}.json")
    print(f"  link {cluster.link.latency_s * 1e6:.0f} us + bytes / "
          f"{cluster.link.bandwidth_Bps / 1e9:.2f} GB/s, overhead "
          f"{cluster.compute_overhead_s * 1e6:.0f} us in, {cluster.action_gap_s * 1e6:.0f} us "
          f"between actions, {overheads['wakeup_s'] * 1e6:.0f} us from a blocked input's "
          f"arrival, {cluster.landing_s * 1e6:.0f} us + {cluster.landing_byte_s * 1e12:.0f} "
          "us/MB a message landing in an action", flush=True)
    tables, replays, choices = [], [], []
    drifts: dict[str, float] = {}
    profile_speeds: dict[str, list[float]] = {}
    contention = [cluster.host_contention]  # readings: the calibration's, then after each grid
    # the gaps likewise (seconds: between ready actions, after a wake-up, one for all; the
    # executor's part of them, the calibration pipeline's stages in place; how a wake-up
    # grows with the wait before it, a micro-benchmark): one reading is one moment's, and a
    # loaded moment reads them 4x (2026-11-24)
    gaps = [(cluster.action_gap_s, cluster.wakeup_gap_s, overheads["between_actions_all_s"],
             overheads["executor_gap_s"], overheads["wakeup_curve"])]
    # and the in-action overhead (seconds): ten grids' calibrations read 0.0-0.20 ms, most
    # 0.035-0.065 (2026-11-24), and 0.17 ms charged on every action of a 100-action step
    in_action = [cluster.compute_overhead_s]
    # the same with phases of 200 steps (~0.1 s) alone and together: an ablation (a
    # pipeline's ranks overlap for an action at a time)
    sustained = [] if args.lean else [host_contention(args.stages, args.threads,
                                                      steps=SUSTAINED_STEPS, pin_cores=args.pin)]
    # and by the calibration's protocol before 2026-11-29, messages only when together
    # (it reads the wait before a step as well): the ablation ring_contention
    ring = [] if args.lean else [host_contention(args.stages, args.threads, pin_cores=args.pin,
                                                 messages="ring")]
    clock.mark("calibration")
    model_readings: dict[str, float] = {}
    in_place: dict[str, list[dict]] = {}  # model -> SpanSlowdown rows (the medians)
    in_place_readings: dict[str, list[list[dict]]] = {}  # model -> each reading's rows
    idle: dict[str, list[dict]] = {}  # model -> IdleCost rows
    idle_readings: dict[str, list[list[dict]]] = {}  # model -> each reading's rows
    checkpoint_rows: dict[str, list[dict]] = {}  # model -> CheckpointExtra rows
    run_on_rows: dict[str, list[dict]] = {}  # model -> RunOnCost rows
    executor_rows: dict[str, list[dict]] = {}  # model -> ExecutorGap rows
    in_place_rows: dict[str, list[dict]] = {}  # model -> InPlaceCost rows
    per_model: dict[str, dict[str, float]] = {}
    measured_all: list = []
    actions_path = results / f"validation_{tag}_actions.csv.gz"
    actions_path.unlink(missing_ok=True)

    def keep_readings() -> None:
        """The readings so far, where the run's summary will hold them (replaced by it at
        the end): what `--repredict` (validation.predict_saved) needs of a cut run."""
        partial = {"host_contention_readings": contention, "gap_readings": gaps,
                   "in_action_readings": in_action, "idle_costs": idle,
                   "idle_cost_readings": idle_readings,
                   "checkpoint_extras": checkpoint_rows, "executor_gaps": executor_rows,
                   "in_place_costs": in_place_rows, "run_on_costs": run_on_rows,
                   "profile_drift_pct": drifts, "phase_seconds": clock.seconds,
                   "cut_short": True}
        (results / f"validation_{tag}.json").write_text(json.dumps(
            {**machine(), "summary": partial, "batch": BATCH, "stages": args.stages},
            indent=2, default=str))

    for name in args.models.split(","):
        sizes_of_model = dict(MODELS[name])
        if args.stages > 4:  # enough layers for 8 stages
            sizes_of_model.update({"mlp": {"depth": 15}, "gpt": {"n_layers": 10},
                                   "unet": {"depth": 3}}[name])
        job = functools.partial(builtin_job, name, BATCH, **sizes_of_model)
        module, loss_fn, x, y = job()
        sizes = sorted({BATCH // c for c in (1, 2, 4, 8, 16)})
        def take_profile(module=module, loss_fn=loss_fn, x=x, y=y, sizes=sizes, name=name):
            return profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=7, warmup=2,
                           progress=False, meta={"model": name})

        before = take_profile()
        clock.mark(f"{name}: profile")
        # the ablation model_contention: contention measured on this model's own layers
        # (forward+backward of the whole model at a quarter of the batch, two processes
        # alone and together in alternation, one step a phase)
        own = None if args.lean else host_contention(
            args.stages, args.threads, steps=1, iterations=30,
            job=functools.partial(builtin_job, name, BATCH // 4, **sizes_of_model),
            pin_cores=args.pin)
        if own is not None:
            model_readings[name] = own
        plans = grid(before, args.stages, BATCH, chunks=(1, 4, 16) if args.quick else (1, 2, 4, 8, 16),
                     checkpoints=("never", "always") if args.quick else
                     ("never", "except_last", "always"),
                     schedules=tuple(args.schedules.split(",")))
        if args.order == "paired":
            plans = paired(plans)
        print(f"{name}: {len(plans)} plans", flush=True)
        clock.mark(f"{name}: own contention, grid")
        # the layout's own contention (the prediction's, the larger of it and the host
        # law binding): each balance's stages computing alone and together in the run's
        # layout, per micro-batch size, the median of --contention-repeats readings
        # (executor.in_place.stage_contention)
        balances = sorted({tuple(p.balance) for p in plans})
        sizes_of_plans = sorted({b for p in plans for b in p.micro_batch_sizes})
        readings = [] if args.lean else [
            stage_contention_readings(job, balance, sizes_of_plans,
                                      repeats=args.contention_repeats,
                                      threads=args.threads, pin_cores=args.pin)
            for balance in balances]
        spans = [row for of_balance in readings for row in median_slowdowns(of_balance)]
        in_place[name] = [dataclasses.asdict(row) for row in spans]
        in_place_readings[name] = [[dataclasses.asdict(row) for row in reading]
                                   for of_balance in readings for reading in of_balance]
        clock.mark(f"{name}: in-place contention")
        # what a wait costs (--idle-costs, the default): each balance's actions after their
        # rank idled, against at its steady pace, in place (executor.in_place.idle_costs;
        # read against the profile below, taken in the same run), --idle-repeats readings
        # of every balance in turn (a slow spell of minutes then weighs on one of each)
        idle_rounds = [{balance: idle_costs(job, balance, sizes_of_plans, rounds=IDLE_ROUNDS,
                                            threads=args.threads, pin_cores=args.pin,
                                            at_once=args.idle_at_once,
                                            kinds=IDLE_KINDS if args.after_wait else ("F", "B"))
                        for balance in balances}
                       for _ in range(args.idle_repeats if args.idle_costs else 0)]
        clock.mark(f"{name}: idle costs")
        # what the order of a stage's actions costs (--run-on): a forward after a forward,
        # a backward after a backward, against the other order, in place
        # (executor.in_place.run_on_costs; sizes of two micro-batches or more)
        run_ons = [row for balance in balances for row in run_on_costs(
            job, balance, [b for b in sizes_of_plans if 2 * b <= BATCH],
            threads=args.threads, pin_cores=args.pin)] if args.run_on else []
        run_on_rows[name] = [dataclasses.asdict(row) for row in run_ons]
        clock.mark(f"{name}: run-on costs")

        # what checkpointing adds to each stage's backward, in place (--checkpoint-extras,
        # the default): charged where a checkpointed backward has no idle cost to read;
        # measured again after the grid and predicted with the mean, as the profile (two
        # readings 40 minutes apart put MLP's last stage's 0.95-1.78 ms against 0.64-1.2)
        # and, from the same steps, each stage's own executor seconds between actions
        # (--executor-gaps, the default), bracketed alike; and the stages' own costs in
        # place (the ablation in_place_costs: each action at them, pipesim.readings.InPlaceCost)
        def measure_stages(job=job, balances=balances, sizes=sizes_of_plans
                           ) -> tuple[list[CheckpointExtra], list[ExecutorGap], list[InPlaceCost]]:
            if not (args.checkpoint_extras or args.executor_gaps):
                return [], [], []
            rows = [row for balance in balances for row in stage_costs(
                job, balance, sizes, threads=args.threads, pin_cores=args.pin)]
            return (checkpoint_extras_of(rows) if args.checkpoint_extras else [],
                    executor_gaps_of(rows) if args.executor_gaps else [],
                    list(in_place_costs_of(rows)))

        stages_before = measure_stages()
        clock.mark(f"{name}: stage costs")

        # (from the predicted iteration time: once per plan, for every pass)
        counts = {p.label(): iterations_for(before, p, cluster, args.iterations,
                                            args.min_seconds) for p in plans}

        def measure_once(ps, job=job, counts=counts):
            return [r.trace for r, _ in spawn_plans(job, ps, iterations=[counts[p.label()]
                                                                         for p in ps],
                                                    warmup=1, pin_cores=args.pin,
                                                    threads_per_rank=args.threads,
                                                    reference=True)]

        # (--profile-between: the machine's speed read between the passes as well)
        between: list[Profile] = []
        measure = in_passes(measure_once, args.passes, args.tie_break or None,
                            (lambda k, into=between, take=take_profile: into.append(take()))
                            if args.profile_between else None)

        traces = measure(plans)
        clock.mark(f"{name}: the grid measured")
        # kept at once, with each plan's measured iteration: the readings after the grid
        # and the predictions (ablations: minutes on 4-8 ranks) come later, and a run cut
        # there (a lent machine's time limit) can still be predicted afterwards with
        # `--repredict`, from what keep_readings writes below
        save_measured_actions(actions_path, name, plans, traces)
        pd.concat([*tables, measured_table(name, plans, traces)], ignore_index=True).to_csv(
            results / f"validation_{tag}.csv", index=False)
        # profiled again once the runs are done: the prediction uses the mean of every
        # profile (before, between the passes, after), the machine's speed as the runs
        # found it on average (this shared VM drifts by 10-20% over minutes)
        after = take_profile()
        clock.mark(f"{name}: profile")
        readings = [before, *between, after]
        prof = Profile.mean(readings, source=f"profile_{tag}_{name}.csv")
        prof.save(results / f"profile_{tag}_{name}.csv")
        # each profile's speed against the first's, in the order taken (% slower; the last
        # is the run's profile drift), and every profile kept (column ``reading``, in that
        # order) to study them later
        profile_speeds[name] = [profile_drift(before, p) for p in readings]
        drifts[name] = profile_speeds[name][-1]
        pd.concat([p.table.assign(reading=k) for k, p in enumerate(readings)]).to_csv(
            results / f"profile_{tag}_{name}_readings.csv.gz", index=False)
        each_wait = [[row for balance, rows in waited.items()
                      for row in with_profile_seconds(rows, prof, cluster, balance)]
                     for waited in idle_rounds]
        waits = mean_readings(*each_wait, statistic=statistics.median) if each_wait else []
        idle[name] = [dataclasses.asdict(row) for row in waits]
        idle_readings[name] = [[dataclasses.asdict(row) for row in rows] for rows in each_wait]
        stages_after = measure_stages()
        clock.mark(f"{name}: stage costs")
        extras = mean_readings(stages_before[0], stages_after[0])
        executor = mean_readings(stages_before[1], stages_after[1])
        placed = mean_readings(stages_before[2], stages_after[2])
        checkpoint_rows[name] = [dataclasses.asdict(row) for row in extras]
        executor_rows[name] = [dataclasses.asdict(row) for row in executor]
        in_place_rows[name] = [dataclasses.asdict(row) for row in placed]
        keep_readings()
        # the host contention likewise: the mean of the readings before and after the grid
        # (on this VM one reading ranges 0.007-0.55 over a day; the ablation
        # so_far_contention: the median of every reading so far, experiments/README.md,
        # session 43)
        contention.append(host_contention(args.stages, args.threads, pin_cores=args.pin))
        if not args.lean:
            sustained.append(host_contention(args.stages, args.threads, steps=SUSTAINED_STEPS,
                                             pin_cores=args.pin))
            ring.append(host_contention(args.stages, args.threads, pin_cores=args.pin,
                                        messages="ring"))
        again = measure_overhead(latency_s=cluster.link.latency_s, pin_cores=args.pin)
        gaps.append((again["between_actions_s"], again["wakeup_s"], again["between_actions_all_s"],
                     again["executor_gap_s"], again["wakeup_curve"]))
        in_action.append(again["in_action_s"])
        clock.mark(f"{name}: readings after the grid")
        keep_readings()
        # (the layout's own contention measured in place, the larger of it and the host
        # law binding: pipesim.readings.SpanSlowdown; the ablation no_in_place_contention
        # leaves it out)
        model_cluster = dataclasses.replace(
            bracketed(cluster, contention[-2:], gaps[-2:], in_action[-2:]),
            idle_costs=tuple(waits), checkpoint_extras=tuple(extras),
            executor_gaps=tuple(executor), host_slowdowns=tuple(spans))
        unbracketed = dataclasses.replace(
            bracketed(cluster, contention[-2:-1], gaps[-2:-1], in_action[-2:-1]),
            idle_costs=tuple(waits), checkpoint_extras=tuple(extras),
            executor_gaps=tuple(executor), host_slowdowns=tuple(spans))
        ablations = {"no_ckpt_cost": (without_columns(prof, CHECKPOINT_COSTS), model_cluster),
                     # messages landing in their receiver's action cost nothing (before
                     # 2026-11-29 13:00)
                     "no_landing": (prof, dataclasses.replace(model_cluster, landing_s=0.0,
                                                              landing_byte_s=0.0)),
                     "no_host_contention": (prof, dataclasses.replace(model_cluster,
                                                                      host_contention=0.0)),
                     # the median of every contention reading so far, the calibration's
                     # and those after each grid (a loaded moment's reading weighs less)
                     "so_far_contention": (prof, dataclasses.replace(
                         model_cluster, host_contention=statistics.median(contention))),
                     **({"sustained_contention": (prof, dataclasses.replace(
                         model_cluster, host_contention=sum(sustained[-2:]) / 2)),
                         "ring_contention": (prof, dataclasses.replace(
                             model_cluster, host_contention=sum(ring[-2:]) / 2)),
                         "model_contention": (prof, dataclasses.replace(
                             model_cluster, host_contention=own)),
                         # the host law alone, as predicted before 2026-11-30 evening
                         "no_in_place_contention": (prof, dataclasses.replace(
                             model_cluster, host_slowdowns=()))}
                        if not args.lean else {}),
                     **({"no_idle_costs": (prof, dataclasses.replace(model_cluster,
                                                                     idle_costs=()))}
                        if waits else {}),
                     # each idle-cost reading alone, as the grids before 2026-12-01 read one
                     **{f"idle_reading_{i}": (prof, dataclasses.replace(
                         model_cluster, idle_costs=tuple(rows)))
                        for i, rows in enumerate(each_wait, 1) if len(each_wait) > 1},
                     # a forward after a backward that waited paying only its own wait
                     # (the in-place "FB" rows left out: measured with --after-wait, as
                     # the 98th-100th grids, 2026-11-29/30, were)
                     **({"no_after_wait": (prof, dataclasses.replace(model_cluster, idle_costs=tuple(
                         x for x in waits if x.kind != "FB")))}
                        if any(x.kind == "FB" for x in waits) else {}),
                     **({"run_on": (prof, dataclasses.replace(model_cluster,
                                                              run_on_costs=tuple(run_ons)))}
                        if run_ons else {}),
                     **({"no_checkpoint_extras": (prof, dataclasses.replace(
                         model_cluster, checkpoint_extras=()))} if extras else {}),
                     **({"no_executor_gaps": (prof, dataclasses.replace(
                         model_cluster, executor_gaps=()))} if executor else {}),
                     **({"in_place_costs": (prof, dataclasses.replace(
                         model_cluster, in_place_costs=tuple(placed)))} if placed else {}),
                     "no_wakeup_curve": (prof, dataclasses.replace(model_cluster,
                                                                   wakeup_curve=())),
                     # one gap for every action, the mean over all (before 2026-11-24)
                     "one_gap": (prof, dataclasses.replace(
                         model_cluster, action_gap_s=sum(g[2] for g in gaps[-2:]) / 2,
                         wakeup_gap_s=None)),
                     "profile_before": (before, model_cluster),
                     **({"profile_ends": (Profile.mean([before, after]), model_cluster),
                         "profile_median": (Profile.median(readings), model_cluster)}
                        if between else {}),
                     "unbracketed": (before, unbracketed)}
        table = predicted_against(prof, plans, model_cluster, traces, name, ablations)
        # (not a prediction: each plan's with the machine's drift during the grid taken
        # out, read by a fixed piece of work beside each plan, validation.drift_tracked)
        table["predicted_ms_drift_tracked"] = drift_tracked(table)
        per_model[name] = per_model_figures(table, traces)
        measured_all += traces
        tables.append(table)
        # written as each model's predictions are done: a run cut short keeps them
        pd.concat(tables, ignore_index=True).to_csv(results / f"validation_{tag}.csv",
                                                    index=False)
        # (confirm_choice alternates the two plans itself: one pass is enough)
        if not args.lean:
            choices.append({"model": name, **confirm_choice(table, plans, measure_once)})
        # every plan replayed (a simulation each, milliseconds): the schedule logic and
        # the gaps alone, each action at its own measured median duration
        for plan, trace in zip(plans, traces, strict=True):
            replays.append({"model": name, "plan": plan.label(),
                            "replay_error_pct": 100 * replay_error(prof, plan, trace,
                                                                   model_cluster)})
        clock.mark(f"{name}: predictions, confirmed choice, replays")
        print(table[["balance", "chunks", "checkpoint", "schedule", "predicted_ms",
                     "measured_ms", "error_pct"]].round(2).to_string(index=False), flush=True)
    table = pd.concat(tables, ignore_index=True)
    replay = pd.DataFrame(replays)
    summary = summarise(table)  # ablations included
    summary["replay_median_abs_error_pct"] = float(replay.replay_error_pct.abs().median())
    summary["replay_max_abs_error_pct"] = float(replay.replay_error_pct.abs().max())
    if choices:
        worst = max(choices, key=lambda c: c["regret_pct"])
        summary["tuner_regret_confirmed_pct"] = max(worst["regret_pct"], 0.0)
        # that model's rounds: their least and largest regret, and whether they disagree
        # on its sign (a tie: validation.confirm_choice)
        summary["tuner_regret_confirmed_range_pct"] = [worst.get("regret_low_pct", 0.0),
                                                       worst.get("regret_high_pct", 0.0)]
        summary["tuner_regret_confirmed_tie"] = bool(worst.get("tie", False))
    noise = pass_noise(measured_all)  # the same plan measured in two passes, minutes apart
    if noise is not None:
        summary["noise_floor_passes_median_pct"], summary["noise_floor_passes_max_pct"] = noise
    summary["passes"] = args.passes
    summary["tie_break"] = args.tie_break
    summary["tie_break_plans"] = sum(bool(t.meta.get("tie_break")) for t in measured_all)
    summary["profile_drift_pct"] = drifts  # after / before - 1, median over sizes
    summary["profile_speeds_pct"] = profile_speeds  # each profile / the first - 1, in order
    summary["host_contention_readings"] = contention
    summary["calibration_overheads"] = overheads  # seconds (in-action, gaps: means, median)
    # (between ready actions, wake-up, one for all, the executor's part) seconds, and the
    # wake-up's growth with the wait before it ((idle, seconds), ...)
    summary["gap_readings"] = gaps
    summary["in_action_readings"] = in_action  # seconds
    summary["host_contention_sustained_readings"] = sustained
    summary["host_contention_ring_readings"] = ring
    summary["host_contention_model_readings"] = model_readings
    summary["in_place_slowdowns"] = in_place
    summary["in_place_slowdown_readings"] = in_place_readings  # each balance's, in turn
    summary["idle_costs"] = idle  # the median of the readings
    summary["idle_cost_readings"] = idle_readings  # each reading, in turn
    summary["checkpoint_extras"] = checkpoint_rows
    summary["run_on_costs"] = run_on_rows
    summary["executor_gaps"] = executor_rows
    summary["in_place_costs"] = in_place_rows
    summary["per_model"] = per_model  # each model's error beside its own pass noise
    summary["tuner_choices"] = choices
    summary["phase_seconds"] = clock.seconds  # wall seconds per phase (PhaseClock)
    meta = {**machine(), "summary": summary, "cluster": cluster.to_dict(), "batch": BATCH,
            "models": {m: MODELS[m] for m in args.models.split(",")}, "torch": torch.__version__,
            "stages": args.stages, "pinned": args.pin, "threads_per_rank": args.threads,
            "cpus": len(os.sched_getaffinity(0))}
    path = write_results(f"validation_{tag}", table, meta, args.subdir)
    replay.to_csv(results / f"validation_{tag}_replay.csv", index=False)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    scatter_predicted_measured(table, hue="model", ax=axes[0], title="iteration time (ms)")
    scatter_predicted_measured(table, x="bubble_meas", y="bubble_pred", hue="model", ax=axes[1],
                               title="mean bubble fraction")
    fig.tight_layout()
    fig.savefig(results / f"validation_{tag}.png", dpi=110)
    print(replay.groupby("model").replay_error_pct.describe().round(2).to_string())
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


def repredict(results: Path, tag: str) -> None:
    """Predict the measured grid ``validation_TAG.csv`` again with today's model."""
    table = predict_saved(results, tag)
    for label, col in (("as saved", "predicted_ms"), ("today's model", "predicted_ms_now")):
        err = (100 * (table[col] / table.measured_ms - 1)).abs()
        print(f"{label:14s}: median |error| {err.median():5.1f}%, max {err.max():5.1f}%")
    floor = noise_floor(table)
    if floor is not None:
        print(f"noise floor    : one schedule measured twice (GPipe and 1F1B at one micro-batch) "
              f"differs by {floor[0]:.1f}% median, {floor[1]:.1f}% max")
    table.to_csv(results / f"validation_{tag}_repredicted.csv", index=False)


if __name__ == "__main__":
    main()
