"""Where does Python's garbage collector run inside a running pipeline?

GPipe's last-stage backwards on the 2-core VM start late and run slow (``action_costs.py``,
``late_backwards``), unexplained by blocking, sending or preemption
(``blocked_wait.py``, ``send_after.py``).  A collection is Python work that no profile
times: this runs plans on pinned gloo ranks as the grid does, with a ``gc.callbacks`` hook
on every rank that logs each collection's start and stop (``perf_counter``) and each
iteration's origin, and places every collection of the measured iterations on the
trace's timeline::

    rank 1  |F|F|..|F|  |B|  |B|  |B| ... |      in_F / in_B: inside an action
                      ^gc     ^gc            between: in the executor's gap
    (rows, the trace, memory: after the last iteration)      outside: not measured

    python experiments/gc_in_pipeline.py [--model unet] [--balance 8,5] [--chunks 16]
        [--schedules gpipe,1f1b] [--iterations 30]
Writes experiments/results/gc_in_pipeline.csv (collections by plan, rank, generation and
place: count, seconds) and .json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.distributed import spawn_plans
from executor.models import builtin_job
from experiments.common import machine, write_results
from pipesim.plan import Plan
from pipesim.trace import metrics

#: where a collection fell: inside a forward or backward, between a rank's actions within
#: a measured iteration, or outside the measured iterations
PLACES = ("in_F", "in_B", "between", "outside")


def _probed_job(log_dir: str, *args: Any, **kwargs: Any):
    """``builtin_job`` on a rank that logs, to ``log_dir/PID.log``, each collection
    (``start|stop GENERATION SECONDS``) and each iteration's origin (``origin RANK
    SECONDS``, from the executor's recorder); the first call installs the hooks."""
    import executor.distributed as distributed

    if not getattr(distributed, "_gc_probe", None):
        log = open(os.path.join(log_dir, f"{os.getpid()}.log"), "w", buffering=1)  # noqa: SIM115

        def hook(phase: str, info: dict) -> None:
            log.write(f"{phase} {info['generation']} {time.perf_counter():.9f}\n")

        class Recorder(distributed.Recorder):  # type: ignore[name-defined,misc]
            def __init__(self, rank: int, device: Any, origin: float = 0.0, **kw: Any):
                log.write(f"origin {rank} {origin:.9f}\n")
                super().__init__(rank, device, origin=origin, **kw)

        gc.callbacks.append(hook)
        distributed.Recorder = Recorder  # type: ignore[attr-defined,misc]
        distributed._gc_probe = True  # type: ignore[attr-defined]
    return builtin_job(*args, **kwargs)


def read_log(path: Path) -> tuple[int, list[float], list[tuple[int, float, float]]]:
    """A rank's log: ``(rank, iteration origins in order, [(generation, start, stop)])``."""
    rank, origins, events, began = -1, [], [], None
    for line in path.read_text().splitlines():
        what, a, t = line.split()
        if what == "origin":
            rank = int(a)
            origins.append(float(t))
        elif what == "start":
            began = (int(a), float(t))
        elif what == "stop" and began is not None:
            events.append((began[0], began[1], float(t)))
            began = None
    return rank, origins, events


def place_collections(actions: pd.DataFrame, rank: int, origins: list[float],
                      events: list[tuple[int, float, float]]) -> pd.DataFrame:
    """Each collection of ``rank`` on the trace's timeline: columns ``rank, generation,
    seconds, place`` (one of :data:`PLACES`).

    ``actions`` is a measured Trace's table: iterations laid end to end, each from its
    origin, the next from the last end of any row of the one before (as
    ``executor.distributed`` lays them).  ``origins`` are the ``perf_counter`` seconds of
    the measured iterations' origins on this rank, in order (the warm-up's left out).  A
    collection belongs to the last iteration begun before it, and is ``outside`` once past
    that iteration's last row (or before the first origin).
    """
    ends = actions.groupby("iteration").end.max().sort_index()
    if len(ends) != len(origins):
        raise ValueError(f"{len(origins)} origins for {len(ends)} measured iterations")
    offsets, offset = [], 0.0
    for end in ends:
        offsets.append(offset)
        offset = float(end)
    mine = actions[(actions.device == rank) & actions.kind.isin(["F", "B"])]
    rows = []
    for generation, start, stop in events:
        place = "outside"
        k = max((i for i, o in enumerate(origins) if o <= start), default=None)
        if k is not None:
            s, e = start - origins[k] + offsets[k], stop - origins[k] + offsets[k]
            if e <= ends.iloc[k]:
                hit = mine[(mine.iteration == ends.index[k]) & (mine.start < e) & (mine.end > s)]
                place = f"in_{hit.kind.iloc[0]}" if len(hit) else "between"
        rows.append({"rank": rank, "generation": generation, "seconds": stop - start,
                     "place": place})
    return pd.DataFrame(rows, columns=["rank", "generation", "seconds", "place"])


def run(model: str, balance: tuple[int, ...], chunks: int, schedules: list[str],
        iterations: int, warmup: int = 2, checkpoint: str = "never",
        pin_cores: bool = True, **sizes: Any) -> pd.DataFrame:
    """Each schedule's plan on ``len(balance)`` pinned ranks; its collections by rank,
    generation and place, with the plan's median iteration (seconds)."""
    from experiments.validate import BATCH, MODELS

    sizes = {**MODELS.get(model, {}), **sizes}
    out = []
    for schedule in schedules:
        plan = Plan(balance=balance, chunks=chunks, batch_size=BATCH,
                    checkpoint=checkpoint, schedule=schedule)
        with tempfile.TemporaryDirectory() as log_dir:
            job = functools.partial(_probed_job, log_dir, model, BATCH, **sizes)
            ((result, _),) = spawn_plans(job, [plan], iterations=iterations, warmup=warmup,
                                         pin_cores=pin_cores)
            actions = result.trace.actions
            per_rank = [read_log(p) for p in sorted(Path(log_dir).glob("*.log"))]
        iteration_s = metrics(result.trace).iteration_time_s
        for rank, origins, events in per_rank:
            placed = place_collections(actions, rank, origins[warmup:warmup + iterations],
                                       events)
            table = (placed.groupby(["rank", "generation", "place"]).seconds
                     .agg(["size", "sum", "median"]).reset_index()
                     .rename(columns={"size": "count", "sum": "total_s", "median": "median_s"}))
            out.append(table.assign(plan=plan.label(), iterations=iterations,
                                    iteration_s=iteration_s))
    return pd.concat(out, ignore_index=True)[
        ["plan", "iterations", "iteration_s", "rank", "generation", "place", "count",
         "total_s", "median_s"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unet")
    ap.add_argument("--balance", default="8,5")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--checkpoint", default="never")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--iterations", type=int, default=30)
    args = ap.parse_args()
    balance = tuple(int(b) for b in args.balance.split(","))
    table = run(args.model, balance, args.chunks, args.schedules.split(","), args.iterations,
                checkpoint=args.checkpoint)
    # what a measured iteration pays (collections outside them are in no iteration)
    per_iteration = table.assign(per_iteration_ms=(1e3 * table.total_s / table.iterations)
                                 .where(table.place != "outside"))
    with pd.option_context("display.width", 160):
        print(per_iteration.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    path = write_results("gc_in_pipeline", table, {**machine(), **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
