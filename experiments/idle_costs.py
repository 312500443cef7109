"""What an action costs more after its rank waited: measured in place, and in a grid's runs.

Inside a running pipeline a rank often waits for its next message: stage 0 of a GPipe
plan runs its forwards, then waits for the first gradient; a one-layer stage waits for its
seven-layer neighbour all the time.  On this project's shared VM whatever the rank had in
its caches fades while it waits (other tenants' work: a Python spin loop fades it as much
as sleeping), and the action after the wait pays the misses.

This measures, for every layout of a committed CPU grid, each stage's forward and backward
after idles of 0.5-20 ms against the same step with its message there at once
(:func:`executor.in_place.idle_costs`: the executor's StageRunner, one rank at a time on
its pinned core; no plan is run), each model profiled before and after as ``validate.py``
profiles it, so that every row also carries the seconds the simulator gives that action
from the mean of the two (``profile_s``: the profile's own regime, read by
:meth:`pipesim.cluster.Cluster.idle_cost`).  Beside it, what the grid's own actions that
ran alone (under 10% of their time beside the other rank's compute) took over the same hot
step, by the idle before them (their worker's previous action's end to their start)::

    python experiments/idle_costs.py [--models mlp,gpt,unet] [--rounds 10]
    python experiments/idle_costs.py --recovery mlp:4,4:0:2   # the pace after one wait
                                    # (writes experiments/results/idle_recovery_MODEL.csv)
    python experiments/grid_history.py --git 7 --repredict \
        --idle experiments/results/idle_costs.json

Writes experiments/results/idle_costs.csv (in place: one row per stage, kind, size,
checkpoint mode and idle), idle_costs_grid.csv (the grid's lone actions, per stage, kind and
idle bin) and idle_costs.json (``idle_costs``: model -> :class:`pipesim.readings.IdleCost`
rows, what ``grid_history.py --idle`` gives the simulator).  About 12 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd
import torch

from executor.in_place import idle_costs
from executor.models import builtin_job
from executor.profiler import profile
from experiments.action_costs import beside_shares, overlap_class, parse_plan
from experiments.common import RESULTS, machine, write_results
from experiments.in_place_contention import layouts
from experiments.validate import BATCH, MODELS
from pipesim.balance import stage_firsts
from pipesim.cluster import Cluster
from pipesim.costs import with_profile_seconds
from pipesim.profile import Profile

#: idles measured (seconds): the grid's waits run from 0.1 ms to tens of milliseconds
IDLES = (0.0005, 0.002, 0.005, 0.02)
#: the grid's lone backwards are binned by the idle before them (seconds)
BINS = (0.0, 0.00025, 0.001, 0.0035, 0.0125, np.inf)


def lone_actions(actions: pd.DataFrame) -> pd.DataFrame:
    """The grid's forwards and backwards that ran alone (:func:`action_costs.overlap_class`),
    with the idle before each (its worker's previous action's end to its start): columns
    model, balance, stage, kind, micro_batch, checkpointed, idle_s, seconds (their own
    duration)."""
    rows = []
    compute = actions[actions.kind.isin(["F", "B"])]
    for (model, label), part in compute.groupby(["model", "plan"]):
        plan = parse_plan(label, BATCH)
        balance = ",".join(map(str, plan.balance))
        for _, it in part.groupby("iteration"):
            it = it.sort_values(["device", "start"])
            idles = (it.start - it.groupby("device").end.shift()).to_numpy()
            for r, idle, share in zip(it.itertuples(), idles, beside_shares(it), strict=True):
                if overlap_class(share) == "alone" and not np.isnan(idle):
                    rows.append((model, balance, r.stage, r.kind,
                                 plan.micro_batch_sizes[r.microbatch],
                                 plan.checkpointed(r.microbatch), idle, r.end - r.start))
    return pd.DataFrame(rows, columns=["model", "balance", "stage", "kind", "micro_batch",
                                       "checkpointed", "idle_s", "seconds"])


def recovery(model: str, balance: list[int], rank: int, size: int, *, idle_s: float = 0.02,
             steps: int = 12, rounds: int = 25) -> pd.DataFrame:
    """How a rank's pace comes back after a wait: stage ``rank``'s in-place steps, one
    after another, right after the rank slept ``idle_s``; per step of the ``rounds``
    bursts, the median forward and backward seconds and the time since the wait ended.
    Pinned to core 0, one process (the other core idle)."""
    import os
    import statistics

    from executor.host_allocator import retain_freed_memory
    from executor.in_place import _stage_step

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    retain_freed_memory()
    step = _stage_step(functools.partial(builtin_job, model, BATCH, **MODELS[model]),
                       balance, rank, size)
    for _ in range(20):
        step()
    times: list[list[tuple[float, float, float]]] = [[] for _ in range(steps)]
    for _ in range(rounds):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        for i in range(steps):
            seconds = step()
            times[i].append((seconds["F"], seconds["B"], time.perf_counter() - t0))
    return pd.DataFrame([{"step": i + 1, **{k: 1e3 * statistics.median(t[j] for t in ts)
                                            for j, k in enumerate(("fwd_ms", "bwd_ms",
                                                                   "elapsed_ms"))}}
                         for i, ts in enumerate(times)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--recovery", default="", metavar="MODEL:BALANCE:RANK:SIZE",
                    help="only time one stage's steps one after another after a 20 ms wait "
                    "(e.g. mlp:4,4:0:2): how its pace comes back")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--grid", type=Path, default=RESULTS / "validation_cpu.csv",
                    help="the grid whose layouts are measured (its folder's "
                    "validation_cpu_actions.csv.gz is compared against)")
    args = ap.parse_args()
    if args.recovery:
        model, balance, rank, size = args.recovery.split(":")
        table = recovery(model, [int(b) for b in balance.split(",")], int(rank), int(size))
        print(f"{args.recovery}: each step after a 20 ms wait (medians of 25 bursts)")
        print(table.round(3).to_string(index=False))
        path = write_results(f"idle_recovery_{model}", table,
                             {**machine(), "layout": args.recovery, "idle_s": 0.02})
        print(f"wrote {path}")
        return
    torch.set_num_threads(1)  # the profiles as validate.py takes them: one thread, as a rank
    grid = pd.read_csv(args.grid)
    actions_path = args.grid.parent / "validation_cpu_actions.csv.gz"
    lone = lone_actions(pd.read_csv(actions_path)) if actions_path.exists() else None
    rows, compared, found = [], [], {}
    cluster = Cluster.load(args.grid.parent / "calibration_cpu.json")
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        balances, sizes = layouts(grid, name)
        module, loss_fn, x, y = job()
        # profiled before and after, as validate.py does: the rows' profile_s from the mean
        before = profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=7, warmup=2,
                         progress=False)
        measured = {}
        for balance in balances:
            t0 = time.perf_counter()
            measured[tuple(balance)] = idle_costs(job, balance, sizes, idle_s=IDLES,
                                                  rounds=args.rounds)
            print(f"{name} {balance} ({time.perf_counter() - t0:.0f} s)", flush=True)
        after = profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=7, warmup=2,
                        progress=False)
        prof = Profile.mean([before, after])
        found[name] = []
        for balance in balances:
            rows_of = with_profile_seconds(measured[tuple(balance)], prof, cluster, balance)
            found[name] += [dataclasses.asdict(x) for x in rows_of]
            firsts = stage_firsts(balance)
            for r in rows_of:
                rows.append({"model": name, "balance": ",".join(map(str, balance)),
                             "stage": firsts.index(r.first), **dataclasses.asdict(r)})
    table = pd.DataFrame(rows)
    # (seconds: the median over sizes, the same on each size's row; the sizes' own apart)
    wide = table.pivot_table(index=["model", "balance", "stage", "kind", "checkpointed"],
                             columns="idle_s", values="seconds", aggfunc="first") * 1e3
    wide.columns = [f"{1e3 * c:g} ms" for c in wide.columns]
    longest = table[table.idle_s == max(IDLES)].assign(
        own=lambda t: 1e3 * (t.after_idle_s - t.hot_s)).pivot_table(
        index=["model", "balance", "stage", "kind", "checkpointed"], columns="micro_batch",
        values="own")
    longest.columns = [f"{b} samples" for b in longest.columns]
    with pd.option_context("display.width", 200, "display.max_rows", 400):
        print("in place: an action's extra ms after its rank idled (median over the sizes)")
        print(wide.round(3).to_string())
        print(f"... each size's own after {1e3 * max(IDLES):g} ms")
        print(longest.round(3).to_string())
        excess = table[table.idle_s == min(IDLES)].assign(
            excess=lambda t: 1e3 * (t.profile_s - t.hot_s)).pivot_table(
            index=["model", "balance", "stage", "kind", "checkpointed"], columns="micro_batch",
            values="excess")
        excess.columns = [f"{b} samples" for b in excess.columns]
        print("the profile's excess (ms) over the action at once (profile_s - hot_s)")
        print(excess.round(3).to_string())
    if lone is not None:
        compared = _against_grid(lone, table)
        with pd.option_context("display.width", 200, "display.max_rows", 400):
            print("the grid's lone actions: median extra ms over in place's hot step, by idle")
            print(compared.round(3).to_string(index=False))
        compared.to_csv(RESULTS / "idle_costs_grid.csv", index=False)
    path = write_results("idle_costs", table, {**machine(), "grid": str(args.grid),
                                               "rounds": args.rounds, "idles_s": list(IDLES),
                                               "idle_costs": found})
    print(f"wrote {path}")


def _against_grid(lone: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Per model, balance, stage, kind and idle bin: the grid's lone actions' median seconds
    over the in-place hot action of their stage, size and mode, and in place's own extra
    at the bin's median idle (interpolated as the simulator does)."""
    keys = ["model", "balance", "stage", "kind", "micro_batch", "checkpointed"]
    merged = lone.merge(table[[*keys, "hot_s"]].drop_duplicates(), on=keys)
    merged["extra_s"] = merged.seconds - merged.hot_s
    merged["bin"] = pd.cut(merged.idle_s, BINS)
    out = []
    for (model, balance, stage, kind, _), part in merged.groupby(
            ["model", "balance", "stage", "kind", "bin"], observed=True):
        if len(part) < 10:
            continue
        idle = float(part.idle_s.median())
        curves = table[(table.model == model) & (table.balance == balance)
                       & (table.stage == stage) & (table.kind == kind)]
        in_place = []
        for (size, ckpt), rows in curves.groupby(["micro_batch", "checkpointed"]):
            n = ((part.micro_batch == size) & (part.checkpointed == ckpt)).sum()
            if n:
                xs = [0.0, *rows.idle_s]
                in_place.append((n, float(np.interp(idle, xs, [0.0, *rows.seconds]))))
        weights = sum(n for n, _ in in_place)
        out.append({"model": model, "balance": balance, "stage": stage, "kind": kind,
                    "actions": len(part),
                    "idle_ms": 1e3 * idle, "grid_extra_ms": 1e3 * float(part.extra_s.median()),
                    "in_place_extra_ms": 1e3 * sum(n * v for n, v in in_place) / weights
                    if weights else float("nan")})
    return pd.DataFrame(out)


if __name__ == "__main__":
    main()
