"""What an action costs inside the running pipeline against the same action alone, paired.

A stage's forward or backward in a ``validate.py`` grid often runs well over what its
profile and in-place readings give it (MLP [4,4]'s first stage at 16 micro-batches:
backwards 1.0-1.5 ms where the stage alone takes 0.85).  Three candidate causes: the
other rank computing beside it (shared caches, memory), the waits before it (a vCPU that
halts, as this VM's ``haltpoll`` idles with no polling), and the messages themselves
(gloo's threads on the rank's core).  Read across minutes, this VM's pace drifts by as
much (the same plan's backward 0.92 -> 1.22 ms a minute apart), so this pairs them:
each round runs the plan as a pipeline (pinned ranks over gloo, every receive posted at
the step's start) and, at once after, every stage alone in the same order on its rank's
core (``executor.stage_alone.SynthTransport``: its inputs synthesised, nothing sent),
optionally sleeping ``--sleep-us`` before each receive, and optionally with the other
stages alone at the same time on their cores (``--together``: the neighbours' compute
without a message), those in one idle gloo process group (``--group``: its threads
started, nothing sent), and optionally waiting before each action as long as that
round's pipeline waited there (``--replay-waits``: slept, :func:`waits`,
``experiments.stage_order_alone.Pacer``)::

    round r   pipeline |== plan, 2 ranks ==|  alone |stage 0|stage 1|  (or together)
              ratio(stage, kind, kind before) = pipeline median / alone median

Per round the ratio of the medians, then the median over rounds (the drift cancels
within a round).  2026-11-30 (3 rounds, 16 micro-batches): MLP [4,4] 1.1-1.5x, the same
with the stages alone at once, still 1.0-1.3x with 150 us asleep before each
receive; GPT [3,3] 1.1-1.3x; U-Net [8,5] 1.0x GPipe, 1.1-1.2x 1F1B (experiments/README.md,
session 48).  With the pipeline's waits replayed (2026-11-30): GPT 0.95-1.18x, U-Net
0.89-1.14x -- their waits are their surcharge -- but MLP still 0.94-1.57x, with the
neighbour computing too (``--together``) 0.83-1.65x (session 49).

    python experiments/pipeline_vs_alone.py [--model mlp] [--balance 4,4] [--chunks 16]
        [--schedules gpipe,1f1b] [--rounds 3] [--iterations 20] [--sleep-us 0]
        [--together [--group]] [--replay-waits] [--name pipeline_vs_alone]
Writes experiments/results/NAME.csv (per schedule, stage, kind and the kind
before: the medians over rounds of the pipeline's and the alone ms, of their ratio, and
of the gaps before, ms) and .json.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist

from executor import stage_alone
from executor.calibrate import _gather
from executor.cores import threads_on
from executor.distributed import _free_port, rank_cores, spawn_plans
from executor.host_allocator import retain_freed_memory
from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.stage_order_alone import summarise as summarise_orders
from experiments.stage_order_alone import time_orders
from experiments.validate import BATCH, MODELS
from pipesim.plan import Plan
from pipesim.trace import Trace

KEYS = ["schedule", "stage", "kind", "before"]


def by_order(actions: pd.DataFrame) -> pd.DataFrame:
    """Median ``seconds`` of a run's forwards and backwards per stage, kind and the kind
    of the stage's action before it in its iteration (the first of each left out), and
    the median ``gap_s`` since that one ended."""
    a = actions[actions.kind.isin(["F", "B"])].sort_values(["iteration", "stage", "start"])
    last = a.groupby(["iteration", "stage"])
    a = a.assign(before=last.kind.shift(1), seconds=a.end - a.start,
                 gap_s=a.start - last.end.shift(1)).dropna(subset=["before"])
    return a.groupby(["stage", "kind", "before"])[["seconds", "gap_s"]].median()


def waits(actions: pd.DataFrame) -> dict[int, list[float]]:
    """Per stage, the seconds each forward or backward at position ``p`` of the stage's
    iteration started after the stage's previous one ended (median over iterations): the
    waits :class:`experiments.stage_order_alone.Pacer` replays.  Position 0's is from the
    previous iteration's last action, iterations laid end to end as the trace lays them
    (so without the barrier between them, ~0.1 ms); the first iteration's has none."""
    a = actions[actions.kind.isin(["F", "B"])].sort_values(["stage", "start"])
    a = a.assign(gap=a.start - a.groupby("stage").end.shift(1),
                 position=a.groupby(["iteration", "stage"]).cumcount())
    medians = a.groupby(["stage", "position"]).gap.median().fillna(0.0)
    return {int(s): [float(v) for v in g] for s, g in medians.groupby(level="stage")}


def _alone(rank: int, model: str, balance: tuple[int, ...], chunks: int, schedule: str,
           iterations: int, sleep_s: float, sizes: dict, port: int,
           gaps: dict[int, list[float]] | None, stages: tuple[int, ...], out) -> None:
    """Stage ``stages[rank]`` alone in ``schedule``'s order on its rank's cores (a
    spawned process of :func:`executor.calibrate._gather`, as a pinned rank runs: one
    torch thread, freed memory kept); puts ``(stage, medians)``.  With a ``port`` the
    stages first join one gloo process group, as the pipeline's ranks do (its threads
    started), and send nothing over it; with ``gaps`` (per stage, :func:`waits`) each
    action waits as long after the one before as in the pipeline."""
    stage = stages[rank]
    if port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage,
                                world_size=len(balance), timeout=timedelta(seconds=60))
    if sleep_s > 0:
        made = stage_alone.SynthTransport.recv

        def late(self, *args, **kwargs):  # the input comes ``sleep_s`` after it is asked
            time.sleep(sleep_s)
            return made(self, *args, **kwargs)

        stage_alone.SynthTransport.recv = late  # type: ignore[method-assign]
    retain_freed_memory()
    torch.set_num_threads(1)
    with threads_on(rank_cores(len(balance))[stage]):
        rows = time_orders(model, balance, chunks, stage, [schedule], iterations,
                           gaps=gaps[stage] if gaps else None, **sizes)
    medians = summarise_orders(rows).set_index(["kind", "before"])
    out.put((stage, medians[["median_s", "median_gap_s"]]))
    if port:
        dist.barrier()
        dist.destroy_process_group()


def alone_medians(model: str, balance: tuple[int, ...], chunks: int, schedule: str,
                  iterations: int, sleep_s: float, together: bool,
                  sizes: dict | None = None, group: bool = False,
                  gaps: dict[int, list[float]] | None = None) -> pd.DataFrame:
    """Every stage of the plan alone on its rank's cores, one after another (or all at
    once with ``together``, in one gloo process group with ``group``): median seconds
    (``median_s``) and gap before (``median_gap_s``) per stage, kind and the kind before
    (``sizes``: the model's, over ``validate.py``'s; ``gaps``: the waits to replay)."""
    if group and not together:
        raise ValueError("group: the stages join one process group, so together")
    port = _free_port() if group else 0
    n = len(balance)
    waves = [tuple(range(n))] if together else [(s,) for s in range(n)]
    parts = dict(item for wave in waves for item in _gather(
        _alone, len(wave), (model, balance, chunks, schedule, iterations, sleep_s,
                            sizes or {}, port, gaps, wave), expected=len(wave)))
    return pd.concat(parts, names=["stage"])


def pair_rounds(model: str, balance: tuple[int, ...], chunks: int, schedules: list[str],
                rounds: int, iterations: int, sleep_s: float = 0.0,
                together: bool = False, sizes: dict | None = None,
                group: bool = False, replay_waits: bool = False) -> pd.DataFrame:
    """Per round and schedule: the pipeline run, then every stage alone; one row per
    round, schedule, stage, kind and kind before with both medians of the action
    (``pipeline_s``, ``alone_s``) and of the gap before it (``pipeline_gap_s``,
    ``alone_gap_s``), seconds.  ``sizes``: the model's, over ``validate.py``'s;
    ``replay_waits``: the stages alone wait as that round's pipeline did (:func:`waits`)."""
    sizes = {**MODELS.get(model, {}), **(sizes or {})}
    job = functools.partial(builtin_job, model, BATCH, **sizes)
    rows = []
    for r in range(rounds):
        for schedule in schedules:
            plan = Plan(list(balance), chunks, BATCH, checkpoint="never", schedule=schedule)
            ((result, _),) = spawn_plans(job, [plan], iterations=iterations, warmup=2,
                                         pin_cores=True)
            trace: Trace = result.trace
            piped = by_order(trace.actions)
            alone = alone_medians(model, balance, chunks, schedule, iterations, sleep_s,
                                  together, sizes, group,
                                  waits(trace.actions) if replay_waits else None)
            both = pd.DataFrame({"pipeline_s": piped.seconds, "alone_s": alone.median_s,
                                 "pipeline_gap_s": piped.gap_s,
                                 "alone_gap_s": alone.median_gap_s}).dropna()
            rows.append(both.reset_index().assign(round=r, schedule=schedule))
    return pd.concat(rows, ignore_index=True)


def summarise(rounds: pd.DataFrame) -> pd.DataFrame:
    """Medians over rounds (ms) and of each round's ratio pipeline / alone."""
    t = rounds.assign(ratio=rounds.pipeline_s / rounds.alone_s)
    out = t.groupby(KEYS).agg(rounds=("ratio", "size"), pipeline_ms=("pipeline_s", "median"),
                              alone_ms=("alone_s", "median"), ratio=("ratio", "median"),
                              pipeline_gap_ms=("pipeline_gap_s", "median"),
                              alone_gap_ms=("alone_gap_s", "median"))
    ms = ["pipeline_ms", "alone_ms", "pipeline_gap_ms", "alone_gap_ms"]
    out[ms] *= 1e3
    return out.reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--balance", default="4,4")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--sleep-us", type=float, default=0.0,
                    help="microseconds each stage alone sleeps before each receive")
    ap.add_argument("--together", action="store_true",
                    help="the stages alone all at once, each on its rank's cores")
    ap.add_argument("--group", action="store_true",
                    help="with --together: the stages in one gloo process group, idle")
    ap.add_argument("--replay-waits", action="store_true",
                    help="each stage alone waits before each action as long as it did in "
                         "that round's pipeline (slept)")
    ap.add_argument("--name", default="pipeline_vs_alone")
    args = ap.parse_args()
    balance = tuple(int(b) for b in args.balance.split(","))
    rounds = pair_rounds(args.model, balance, args.chunks, args.schedules.split(","),
                         args.rounds, args.iterations, args.sleep_us * 1e-6, args.together,
                         group=args.group, replay_waits=args.replay_waits)
    table = summarise(rounds)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    path = write_results(args.name, table, {**machine(), **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
