"""Does a stage's own order of actions set its pace? One stage alone, in each schedule's order.

In the pipeline, GPipe's last stage runs its backwards back to back after all its
forwards, and many run late and slow (``action_costs.py``, ``late_backwards``), where
1F1B's alternate with forwards.  Here that stage runs alone in one pinned process, its
neighbours' tensors synthesised (``executor.stage_alone.SynthTransport``), its actions in
each schedule's order, timed as the pipeline times them (``executor.recorder``)::

    gpipe   |F0|F1|..|F15|B15|B14|..|B0|       B after B: the activations saved long ago
    1f1b    |F0|F1|B0|F2|B1|..|B15|           B after F: the activations just made

If a backward after a backward runs slower here too, the order (caches, the stash) is the
cause; if not, the cause needs the other rank.

    python experiments/stage_order_alone.py [--model unet] [--balance 8,5] [--chunks 16]
        [--stage 1] [--iterations 20] [--rounds 3]
Writes experiments/results/stage_order_alone.csv (median seconds and gap before, by
schedule, kind and the kind before) and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.cores import threads_on
from executor.host_allocator import retain_freed_memory
from executor.microbatch import scatter
from executor.models import builtin_job
from executor.partition import split_module
from executor.pipeline import stage_skips
from executor.recorder import Recorder
from executor.stage import StageRunner
from executor.stage_alone import SynthTransport, message_shapes
from experiments.common import machine, write_results
from pipesim.plan import Plan
from pipesim.schedule import build_schedule


@dataclass
class Pacer:
    """Replays a pipeline's waits: the F or B at position ``p`` of a stage's iteration
    starts no sooner than ``gaps[p]`` seconds after the stage's previous F or B ended
    (position 0: the previous iteration's last), the rest slept (``time.sleep``: the core
    halts, as in a receive's wait).  ``gaps`` is per position, so one list serves every
    iteration::

        pipeline  |F0|  wait  |F1| wait |B0|       gaps = [g0, g1, g2, ...]
        alone     |F0|-sleep--|F1|-sleep|B0|       each gap slept up to its length
    """

    gaps: Sequence[float]
    position: int = 0
    last_end: float | None = None
    #: how late the last sleeps ended (seconds past what each asked for: 70-110 us at the
    #: median on the 2-core VM, the timer's slack and a halted core's wake-up); their
    #: median is taken off each sleep, so that the gaps come out as long as the
    #: pipeline's, not a sleep's lateness longer
    lateness: deque[float] = field(default_factory=lambda: deque(maxlen=15))

    @property
    def late(self) -> float:
        """Seconds a sleep is expected to end late (0 before any)."""
        return statistics.median(self.lateness) if self.lateness else 0.0

    def wait(self) -> None:
        if self.last_end is not None:
            target = self.last_end + self.gaps[self.position % len(self.gaps)]
            now = time.perf_counter()
            ask = target - now - self.late
            if ask > 0:
                time.sleep(ask)
                self.lateness.append(time.perf_counter() - now - ask)
        self.position += 1

    def ended(self) -> None:
        self.last_end = time.perf_counter()


@dataclass
class PacedRecorder(Recorder):
    """A :class:`~executor.recorder.Recorder` whose forwards and backwards wait for a
    :class:`Pacer` before they start."""

    pacer: Pacer | None = None

    def start(self, stage: int, mb: int, kind: str) -> None:
        if self.pacer is not None and kind in ("F", "B"):
            self.pacer.wait()
        super().start(stage, mb, kind)

    def stop(self, stage: int, mb: int, kind: str, nbytes: int = 0, resource: str = "") -> None:
        super().stop(stage, mb, kind, nbytes, resource)
        if self.pacer is not None and kind in ("F", "B"):
            self.pacer.ended()


def time_orders(model: str, balance: tuple[int, ...], chunks: int, stage: int,
                schedules: list[str], iterations: int, rounds: int = 1,
                warmup: int = 2, gaps: Sequence[float] | None = None,
                **sizes) -> pd.DataFrame:
    """Every F and B of ``stage`` run alone in each schedule's order: one row per action
    (``schedule, round, iteration, kind, before, seconds, gap_s``; ``before`` the kind of
    the stage's previous action in that iteration, ``gap_s`` the seconds since it ended).
    The schedules alternate ``rounds`` times, so that the machine's pace weighs on both.
    ``gaps`` (seconds per position in the stage's iteration, one schedule): each action
    waits that long after the one before, as in a pipeline (:class:`Pacer`)."""
    from experiments.validate import BATCH, MODELS

    if gaps is not None and len(schedules) != 1:
        raise ValueError(f"gaps: one schedule's waits, for {len(schedules)} schedules")
    cpu = torch.device("cpu")
    module, loss_fn, x, y = builtin_job(model, BATCH, **{**MODELS.get(model, {}), **sizes})
    rows = []
    for r in range(rounds):
        for schedule in schedules:
            plan = Plan(balance=balance, chunks=chunks, batch_size=BATCH,
                        checkpoint="never", schedule=schedule)
            order = build_schedule(plan)
            actions = tuple(a for a in order.order[order.placement[stage]] if a.stage == stage)
            part = split_module(module, plan.balance)[stage]
            transport = SynthTransport(message_shapes(module, plan, x), cpu)
            xs, ys = scatter(x, plan), scatter(y, plan)
            paced = sum(a.kind in ("F", "B") for a in actions)
            if gaps is not None and len(gaps) != paced:
                raise ValueError(f"gaps: {len(gaps)} for stage {stage}'s {paced} forwards "
                                 f"and backwards in {schedule}")
            pacer = Pacer(gaps) if gaps is not None else None
            for i in range(warmup + iterations):
                part.zero_grad(set_to_none=True)
                recorder = PacedRecorder(0, cpu, origin=time.perf_counter(), pacer=pacer)
                StageRunner(0, {stage: part}, plan, loss_fn, cpu, transport, recorder,
                            skips=stage_skips(module, plan)).run(actions, xs, ys)
                done = [row for row in recorder.rows(i) if row[4] in ("F", "B")]
                if i < warmup:
                    continue
                done.sort(key=lambda row: row[5])
                for before, row in zip([None, *done], done, strict=False):
                    rows.append({"schedule": schedule, "round": r, "iteration": i - warmup,
                                 "kind": row[4], "before": before[4] if before else "",
                                 "seconds": row[6] - row[5],
                                 "gap_s": row[5] - before[6] if before else float("nan")})
    return pd.DataFrame(rows)


def summarise(actions: pd.DataFrame) -> pd.DataFrame:
    """Median seconds and gap by schedule, kind and the kind before (the first action of
    an iteration, with none before, left out)."""
    return (actions[actions.before != ""]
            .groupby(["schedule", "kind", "before"])
            .agg(actions=("seconds", "size"), median_s=("seconds", "median"),
                 median_gap_s=("gap_s", "median")).reset_index())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unet")
    ap.add_argument("--balance", default="8,5")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=1, help="the core the process runs on")
    args = ap.parse_args()
    # as a pinned rank runs: one core, one torch thread, freed memory kept
    retain_freed_memory()
    torch.set_num_threads(1)
    with threads_on({args.core}):
        actions = time_orders(args.model, tuple(int(b) for b in args.balance.split(",")),
                              args.chunks, args.stage, args.schedules.split(","),
                              args.iterations, args.rounds)
    table = summarise(actions)
    with pd.option_context("display.width", 160):
        print(table.to_string(index=False, float_format=lambda v: f"{v * 1e3:.3f} ms"
                              if v < 1 else f"{v:.0f}"))
    path = write_results("stage_order_alone", table, {**machine(), **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
