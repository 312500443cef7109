"""Which part of a computing neighbour slows a stage's actions in the pipeline.

MLP [4,4]'s first stage runs its actions 1.1-1.6x the same stage alone in the same order
(``experiments/pipeline_vs_alone.py``), but only beside a neighbour that computes *and*
exchanges: a neighbour computing without messages, or messages from a neighbour that
computes nothing, cost it little (``pipesim/MODEL.md``, "What the running pipeline adds to
an action").  Here the pipeline stays the same -- the same ranks, schedule, messages and
first stage -- and only the *last* stage's work is replaced by a stand-in that lasts as
long as the real stage's actions did in that round's real run::

    real    the model's own last stage
    spin    a busy loop (the core busy, next to no memory touched)
    stream  a loop over a buffer of --stream-mib MiB (the core busy, memory traffic)
    sleep   asleep (the core idle: the messages alone)

so what differs between the variants is what the neighbour's core does while the first
stage computes.  Each round runs the first stage alone in the same order on its core
(``pipeline_vs_alone.alone_medians``), the real pipeline, the stand-ins one after another
in fresh processes (their order turned by one each round), and the first stage alone
again: per variant, schedule, kind and kind before, the first stage's median action over
the mean of its two medians alone (the round's drift cancels), then the median over
rounds.

    python experiments/neighbour_standin.py [--model mlp] [--balance 4,4] [--chunks 8]
        [--schedules gpipe,1f1b] [--rounds 5] [--iterations 20] [--stream-mib 8]
        [--variants real,spin,stream,sleep] [--name neighbour_standin]
Writes experiments/results/NAME.csv (per variant, schedule, kind and kind before: the
rounds, the first stage's median ms in the pipeline and alone, their ratio, and the
stand-in's seconds) and .json.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
from torch import nn

from executor.distributed import spawn_plans
from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.pipeline_vs_alone import alone_medians, by_order
from experiments.validate import BATCH, MODELS
from pipesim.plan import Plan

VARIANTS = ("real", "spin", "stream", "sleep")


_SPIN_C = r"""
#include <time.h>
void spin(double seconds) {  /* busy on the core, registers only, until seconds pass */
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) + 1e-9 * (t.tv_nsec - t0.tv_nsec) < seconds);
}
"""


@functools.cache
def _spin() -> Any:
    """A C busy loop called through ctypes, which lets go of the interpreter meanwhile (a
    Python loop would hold it, and the rank's own message threads would wait on it)."""
    import ctypes
    import subprocess
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="spin"))
    (folder / "spin.c").write_text(_SPIN_C)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(folder / "spin.so"),
                    str(folder / "spin.c")], check=True)
    spin = ctypes.CDLL(str(folder / "spin.so")).spin
    spin.argtypes = [ctypes.c_double]
    return spin


def _occupy(mode: str, seconds: float, buffer: torch.Tensor | None) -> None:
    """Spend ``seconds`` as ``mode`` says: busy on the core alone (``spin``), busy
    streaming through ``buffer`` (``stream``), or asleep (``sleep``); the interpreter let
    go of as a torch operation lets go of it."""
    if mode == "sleep":
        time.sleep(seconds)
    elif mode == "spin":
        _spin()(seconds)
    else:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and buffer is not None:
            buffer.add_(1.0)  # reads and writes the whole buffer once


class _Occupied(torch.autograd.Function):
    """Identity on ``x``'s first ``width`` features whose forward and backward take fixed
    seconds (:func:`_occupy`); its input gradient is zero-padded back to ``x``'s shape."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, mode: str, fwd_s: float,
                bwd_s: float, buffer: torch.Tensor | None) -> torch.Tensor:
        _occupy(mode, fwd_s, buffer)
        ctx.shape, ctx.mode, ctx.bwd_s, ctx.buffer = x.shape, mode, bwd_s, buffer
        return x[:, :width].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        _occupy(ctx.mode, ctx.bwd_s, ctx.buffer)
        full = grad.new_zeros(ctx.shape)
        full[:, :grad.shape[1]] = grad
        return full, None, None, None, None, None


class StandIn(nn.Module):
    """A last stage that outputs ``width`` features of its input, each forward and backward
    lasting ``fwd_s`` / ``bwd_s`` seconds spent as ``mode`` (:data:`VARIANTS` but real)."""

    def __init__(self, width: int, mode: str, fwd_s: float, bwd_s: float, stream_mib: float):
        super().__init__()
        self.width, self.mode, self.fwd_s, self.bwd_s = width, mode, fwd_s, bwd_s
        self.stream_mib = stream_mib
        self.buffer: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "stream" and self.buffer is None:  # made in the rank's own process
            self.buffer = torch.zeros(int(self.stream_mib * 2**20) // 4)
        return _Occupied.apply(x, self.width, self.mode, self.fwd_s, self.bwd_s, self.buffer)


def standin_job(model: str, balance: tuple[int, ...], mode: str, fwd_s: float, bwd_s: float,
                stream_mib: float, **sizes: Any) -> tuple:
    """``builtin_job``'s model with its last stage's layers replaced by one :class:`StandIn`
    and identities (so the balance still splits it alike), for ``mode`` other than
    ``real``; the loss and the data unchanged."""
    module, loss_fn, x, y = builtin_job(model, BATCH, **sizes)
    if mode == "real":
        return module, loss_fn, x, y
    first = sum(balance[:-1])
    with torch.no_grad():
        width = module(x[:1]).shape[1]  # the model's output: what the loss reads
    layers = [*module[:first], StandIn(width, mode, fwd_s, bwd_s, stream_mib)]
    layers += [nn.Identity() for _ in range(len(module) - first - 1)]
    return nn.Sequential(*layers), loss_fn, x, y


def _last_stage_seconds(actions: pd.DataFrame) -> tuple[float, float]:
    """The last stage's median forward and backward seconds in a run (its warm-up left out)."""
    last = actions[(actions.stage == actions.stage.max()) & (actions.iteration > 0)]
    seconds = last.end - last.start
    return float(seconds[last.kind == "F"].median()), float(seconds[last.kind == "B"].median())


def rounds_table(model: str, balance: tuple[int, ...], chunks: int, schedules: list[str],
                 rounds: int, iterations: int, variants: list[str], stream_mib: float
                 ) -> pd.DataFrame:
    """One row per round, variant, schedule and the first stage's kind and kind before:
    its median seconds in the pipeline (``seconds``) and alone (``alone_s``), and the
    stand-in's seconds (``standin_fwd_s``, ``standin_bwd_s``: the real last stage's
    medians in that round)."""
    sizes = MODELS.get(model, {})
    rows = []
    for r in range(rounds):
        for schedule in schedules:
            plan = Plan(list(balance), chunks, BATCH, checkpoint="never", schedule=schedule)
            # the first stage alone in the same order before and after the variants (the
            # round's pace: the mean of the two), the stand-ins in an order turned by one
            # each round after the real stage, which times them
            first = alone_medians(model, balance, chunks, schedule, iterations, 0.0, False,
                                  sizes).loc[0].median_s
            stand_ins = variants[1:]
            turn = r % len(stand_ins) if stand_ins else 0
            fwd_s = bwd_s = 0.0
            runs = []
            for mode in ["real", *stand_ins[turn:], *stand_ins[:turn]]:
                job = functools.partial(standin_job, model, balance, mode, fwd_s, bwd_s,
                                        stream_mib, **sizes)
                ((result, _),) = spawn_plans(job, [plan], iterations=iterations, warmup=2,
                                             pin_cores=True, track_memory=False)
                actions = result.trace.actions
                if mode == "real":
                    fwd_s, bwd_s = _last_stage_seconds(actions)
                runs.append(by_order(actions).loc[0].reset_index().assign(
                    round=r, schedule=schedule, variant=mode, standin_fwd_s=fwd_s,
                    standin_bwd_s=bwd_s))
            last = alone_medians(model, balance, chunks, schedule, iterations, 0.0, False,
                                 sizes).loc[0].median_s
            alone = (first + last) / 2
            for run in runs:
                run["alone_s"] = [alone.get((k, b), float("nan"))
                                  for k, b in zip(run.kind, run.before, strict=True)]
            rows += runs
    return pd.concat(rows, ignore_index=True)


def _continuous(rank: int, roles: tuple[str, str], model: str, balance: tuple[int, ...],
                size: int, seconds: float, stream_mib: float, start: Any, out: Any) -> None:
    """Rank ``rank`` of :func:`continuous_rounds` (a process of
    :func:`executor.calibrate._gather`, pinned to its own core), as ``roles[rank]`` says:
    ``"measure"`` times the first stage's forward+backward on ``size`` samples over and
    over for ``seconds`` (puts the median step), any other keeps its core as
    :data:`VARIANTS` says (``"real"``: the last stage's forward+backward), or ``"idle"``
    asleep, for as long."""
    role = roles[rank]
    torch.set_num_threads(1)
    from executor.partition import split_module

    module, loss_fn, x, y = builtin_job(model, BATCH, **MODELS.get(model, {}))
    stages = split_module(module, list(balance))
    first, last = stages[0], stages[-1]
    width = first(x[:1]).shape[1]
    buffer = torch.zeros(int(stream_mib * 2**20) // 4) if role == "stream" else None

    def step() -> None:
        out_ = first(x[:size])
        out_.backward(torch.ones_like(out_))

    def neighbour() -> None:
        if role == "real":
            loss_fn(last(x.new_zeros(size, width).requires_grad_()), y[:size]).backward()
        else:
            _occupy(role, 1e-3, buffer)

    for _ in range(20):  # warm: allocator, caches
        step() if role == "measure" else neighbour()
    start.wait()
    end = time.perf_counter() + seconds
    times = []
    while time.perf_counter() < end:
        if role == "measure":
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        elif role == "idle":
            time.sleep(0.01)
        else:
            neighbour()
    out.put((role, statistics.median(times) if times else math.nan))


def continuous_rounds(model: str, balance: tuple[int, ...], size: int, rounds: int,
                      variants: list[str], stream_mib: float, seconds: float = 1.0
                      ) -> pd.DataFrame:
    """No pipeline, no message: the first stage's forward+backward over and over on core 0
    while core 1 idles, then beside each variant's work on core 1 (``real``: the last
    stage's steps), one second each in fresh processes; one row per round and variant
    with the median step over the idle one's (``ratio``)."""
    import multiprocessing

    from executor.calibrate import _gather

    def median_step(neighbour: str) -> float:
        start = multiprocessing.get_context("spawn").Barrier(2)
        got = dict(_gather(_continuous, 2, (("measure", neighbour), model, balance, size,
                                            seconds, stream_mib, start),
                           expected=2, pin_cores=True))
        return float(got["measure"])

    rows = []
    for r in range(rounds):
        for mode in variants:
            alone = median_step("idle")
            rows.append({"round": r, "variant": mode, "alone_s": alone,
                         "beside_s": median_step(mode)})
    table = pd.DataFrame(rows)
    return table.assign(ratio=table.beside_s / table.alone_s)


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per variant, schedule, kind and kind before: medians over rounds (ms) and of each
    round's ratio pipeline / alone."""
    t = table.assign(ratio=table.seconds / table.alone_s)
    out = (t.groupby(["variant", "schedule", "kind", "before"], sort=False)
           .agg(rounds=("ratio", "size"), pipeline_ms=("seconds", "median"),
                alone_ms=("alone_s", "median"), ratio=("ratio", "median"),
                gap_ms=("gap_s", "median"), standin_fwd_ms=("standin_fwd_s", "median"),
                standin_bwd_ms=("standin_bwd_s", "median")))
    ms = ["pipeline_ms", "alone_ms", "gap_ms", "standin_fwd_ms", "standin_bwd_ms"]
    out[ms] *= 1e3
    return out.reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--balance", default="4,4")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--stream-mib", type=float, default=8.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--continuous", type=int, default=0, metavar="SIZE",
                    help="instead: no pipeline, the first stage's steps on SIZE samples on "
                    "core 0 beside each variant's work on core 1 (NAME_continuous)")
    ap.add_argument("--name", default="neighbour_standin")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if variants[0] != "real" or set(variants) - set(VARIANTS):
        ap.error(f"--variants: 'real' first, then any of {VARIANTS[1:]}, got {args.variants}")
    balance = tuple(int(b) for b in args.balance.split(","))
    if args.continuous:
        steps = continuous_rounds(args.model, balance, args.continuous, args.rounds, variants,
                                  args.stream_mib)
        out = steps.groupby("variant", sort=False).agg(
            rounds=("ratio", "size"), alone_ms=("alone_s", "median"),
            beside_ms=("beside_s", "median"), ratio=("ratio", "median"),
            ratio_low=("ratio", "min"), ratio_high=("ratio", "max")).reset_index()
        out[["alone_ms", "beside_ms"]] *= 1e3
        print(out.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        path = write_results(f"{args.name}_continuous", out, {**machine(), **vars(args)})
        print(f"wrote {path}")
        return
    table = rounds_table(args.model, balance, args.chunks, args.schedules.split(","),
                         args.rounds, args.iterations, variants, args.stream_mib)
    out = summarise(table)
    print(out.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    path = write_results(args.name, out, {**machine(), **vars(args),
                                          "rounds_seen": int(table["round"].nunique()),
                                          "median_ratio": statistics.median(
                                              out.ratio.dropna().tolist() or [float("nan")])})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
