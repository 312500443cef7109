"""Does a message reach its receiver later when its sender computes right after it?

In GPipe's phases a stage sends and goes straight on to its next action; in 1F1B's it
more often waits for its next input.  Pooled over the committed CPU grids, a U-Net
message (128 KiB and up) whose receiver was already waiting took 0.38 ms from post to
receipt at the median and 1.2 ms on average where its sender had started computing
before the receipt, against 0.14 / 0.31 ms where it had not (GPipe [8,5] at 16
micro-batches, 2026-11-27).  Here two ranks pinned to a core each (gloo, a process group
per direction, as the executor sends) isolate that.  Each round rank 0 computes 1 ms,
sends ``count`` messages of ``nbytes``, then computes 2 ms (``compute``: small matmuls,
or with ``--model`` a grid's first stage's forwards) or sleeps as long (``sleep``), and
rank 1, the receiver:

* ``waits``: its receives posted before the send (as the executor posts them while the
  action before runs), waiting;
* ``late``: posts them 0.5 ms after the send (gloo then writes the bytes from the
  sender's I/O thread, which shares the sender's core with its compute);
* ``busy``: posted before, computing until 0.5 ms after the send, then waiting;
* ``next``: posted before, and posting the receives of its next messages (sent after the
  round) as the send comes, then waiting -- what the executor did until 2026-11-27 at the
  start of every action (its next action's receives, then its own input's wait)::

    rank 0   |compute 1 ms| isend x count |compute 2 ms ......|      (or sleep 2 ms)
    rank 1   waits:  posted ....... wait ....^ received
             late:   ............ post, wait ....^ received
             busy:   posted |compute .......| wait ..^ received
             next:   posted ....... post next, wait ....^ received

The delivery is timed from the send's post to the last receive's return (both ranks read
one monotonic clock).  The eight conditions alternate within each round; medians, means
and 90th percentiles over rounds.

Seen on this project's VM (2026-11-27, 75 rounds): whatever the receiver, the sender
computing or sleeping after its send delivers alike -- 2 x 128 KiB to a waiting receiver
0.20 / 0.19 ms (median, compute / sleep), to a late one 0.78 / 0.78 (0.18 / 0.11 after its
post, on average), to a busy one 0.04-0.08 ms after it is done (on average); with
``--model unet`` (each rank computing the U-Net's first stage's forwards, the busy receiver
too: until the forward running 0.5 ms past the send ends) 0.21 / 0.21, 0.81 / 0.81, and
0.035 / 0.026 ms after the busy receiver is done, none over 1 ms.  So the grids' slow
messages are not the sender's I/O waiting behind its next action, nor the receiver's
behind its own.  **But a receiver that posts its next receives as a message comes stalls
it**: 2 x 128 KiB 0.24 / 0.25 ms at the median but 1.24 / 1.33 on average, 31-32% over 1
ms, 4.1-4.2 ms at the 90th percentile; 2 x 32 KiB 25-43% over 1 ms; 2 x 512 KiB 2.6-2.9 ms
at the median (``next``, against ``waits``' 0.2 ms and 0-9%; the run with ``--model unet``
predates that condition).  The executor now posts a stage's next receives once its
action's inputs are in (:meth:`executor.stage.StageRunner._inputs_in`).
``--pipelines`` runs the calibration pipeline (an MLP, two ranks, 16 micro-batches; this
was run before that change) under GPipe and 1F1B with 16-256 KiB messages and reads its
inputs' transits as ``phase_errors.py`` reads the grids' (where the U-Net's, sender
computing, average 0.63-0.67 ms, 15% over 1 ms): under GPipe with the sender computing, 128
and 256 KiB average 0.25 and 0.31 ms, 1.0% and 0.4% over 1 ms
(``send_then_compute_pipelines.csv``): its stages rarely post a receive while a message
streams in, where the U-Net's last stage, keeping pace with its first, did at nearly
every forward.

    python experiments/send_then_compute.py [--rounds 80] [--model unet --name NAME]
                                            [--pipelines] [--subdir gpu]
Writes experiments/results/send_then_compute.csv (one row per case and condition; ``NAME``
for another ``--name``; ``NAME_pipelines`` with ``--pipelines``: one row per schedule,
message size and whether the sender computed) and .json.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from executor.calibrate import _gather
from executor.distributed import _free_port, directional_groups
from executor.models import builtin_job
from executor.transport import _work
from experiments.common import machine, write_results

#: (bytes per message, messages per round): the CPU grid's GPT (32 KiB) and U-Net (128 KiB
#: and up, two a step: its output and a skip) messages at 8-16 micro-batches
CASES = ((32 << 10, 2), (128 << 10, 1), (128 << 10, 2), (512 << 10, 2))
#: (the receiver: posted ahead and waiting, posting late, posted ahead and computing past
#: the send, or posted ahead and posting its next message's receives as the send comes;
#: what the sender does after sending), alternated within each round
CONDITIONS = tuple((receiver, after) for receiver in ("waits", "late", "busy", "next")
                   for after in ("compute", "sleep"))
SKIPPED = 5  # first rounds: connections being set up
BEFORE_S, AFTER_S, LATE_S = 1e-3, 2e-3, 0.5e-3


def _spin(seconds: float, a: torch.Tensor) -> torch.Tensor:
    """Compute for ``seconds`` (small matmuls, as a stage's layers)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh(a @ a)
    return a


def _stage_forwards(model: str, layers: int, samples: int) -> Callable[[float], None]:
    """Compute for a given number of seconds as a grid's first stage does: forwards of the
    first ``layers`` layers of the grid's built-in ``model`` on ``samples`` samples, each
    graph dropped after it (its memory freed as a backward would)."""
    from experiments.validate import MODELS

    module, _loss, x, _y = builtin_job(model, samples, **MODELS[model])
    head = module[:layers]

    def compute(seconds: float) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            head(x).sum()

    return compute


def _exchange(rank: int, port: int, nbytes: int, count: int, rounds: int, width: int,
              stage: tuple[str, int, int] | None, out) -> None:
    """One rank of the exchange (run under :func:`executor.calibrate._gather`, which pins
    it): per round and condition, rank 0 reports when it posted its sends, rank 1 when the
    last message was in."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    up, _down = directional_groups()  # rank 0 -> 1 over ``up``, as the executor's forwards
    a = torch.randn(width, width) / width ** 0.5
    # (each rank's compute: small matmuls, or a grid's first stage: (model, layers, samples))
    stage_compute = _stage_forwards(*stage) if stage is not None else None

    def compute(seconds: float) -> None:
        nonlocal a
        if stage_compute is not None:
            stage_compute(seconds)
        else:
            a = _spin(seconds, a)

    times: list[tuple] = []
    tag = 0
    for r in range(rounds):
        for receiver, after in CONDITIONS:
            tag += 1
            if rank == 0:
                sent = [torch.ones(nbytes // 4) for _ in range(count)]
                dist.barrier()
                a = _spin(BEFORE_S, a)  # (precise: the receiver's timing counts on it)
                t_post = time.perf_counter()
                works = [_work(dist.isend(s, 1, tag=tag * 8 + k, group=up))
                         for k, s in enumerate(sent)]
                if after == "compute":
                    compute(AFTER_S)
                else:
                    time.sleep(AFTER_S)
                for w in works:
                    w.wait()
                if receiver == "next":  # the messages whose receives rank 1 posted meanwhile
                    for w in [_work(dist.isend(s, 1, tag=tag * 8 + 4 + k, group=up))
                              for k, s in enumerate(sent)]:
                        w.wait()
                times.append((r, receiver, after, t_post))
            else:
                bufs = [torch.empty(nbytes // 4) for _ in range(count)]
                if receiver != "late":
                    works = [_work(dist.irecv(b, 0, tag=tag * 8 + k, group=up))
                             for k, b in enumerate(bufs)]
                dist.barrier()
                if receiver == "busy":
                    # computing as the message comes, until LATE_S after the send's post at
                    # least (a stage's forwards: until the one running then ends)
                    compute(BEFORE_S + LATE_S)
                if receiver == "late":
                    # the sender posts after BEFORE_S; post ours LATE_S after that
                    time.sleep(BEFORE_S + LATE_S)
                    works = [_work(dist.irecv(b, 0, tag=tag * 8 + k, group=up))
                             for k, b in enumerate(bufs)]
                later = []
                if receiver == "next":
                    # as the executor does before it waits: the next action's receives,
                    # posted here as the sender posts its send
                    a = _spin(BEFORE_S, a)
                    later = [_work(dist.irecv(torch.empty(nbytes // 4), 0, tag=tag * 8 + 4 + k,
                                              group=up)) for k in range(count)]
                ready = time.perf_counter()
                for w in works:
                    w.wait()
                times.append((r, receiver, after, time.perf_counter(), ready))
                for w in later:
                    w.wait()
            dist.barrier()  # both done before the next condition
    dist.destroy_process_group()
    out.put({"rank": rank, "times": times})


def delivery_table(sender: list[tuple], receiver: list[tuple]) -> pd.DataFrame:
    """Per round and condition, the seconds from the sender's post to the receiver
    holding the last message (``delivery_ms``) and from the later of the post and the
    receiver's readiness (its compute done, a late post made) to then (``wait_ms``: what
    the grids' ``transit`` reads, :func:`experiments.phase_errors.message_transits`),
    rounds before :data:`SKIPPED` left out.  ``sender`` holds ``(round, receiver, after,
    post)``, ``receiver`` ``(round, receiver, after, receipt, ready)``."""
    posts = {(r, p, a): t for r, p, a, t in sender}
    rows = [{"round": r, "receiver": p, "after": a,
             "delivery_ms": 1e3 * (t - posts[(r, p, a)]),
             "wait_ms": 1e3 * (t - max(posts[(r, p, a)], ready))}
            for r, p, a, t, ready in receiver if (r, p, a) in posts and r >= SKIPPED]
    return pd.DataFrame(rows, columns=["round", "receiver", "after", "delivery_ms", "wait_ms"])


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per case and condition: the delivery's median, mean, 90th percentile (ms) and share
    over 1 ms, and the wait after the receiver was ready: its mean and share over 1 ms."""
    def over(x: pd.Series) -> float:
        return float((x > 1.0).mean())

    groups = table.groupby(["bytes", "messages", "receiver", "after"])
    out = groups.delivery_ms.agg(rounds="size", median="median", mean="mean",
                                 p90=lambda x: float(np.quantile(x, 0.9)), over_1ms=over)
    waits = groups.wait_ms.agg(wait_mean="mean", wait_over_1ms=over)
    return out.join(waits).reset_index()


#: the calibration pipeline's (width, samples a micro-batch) for ``--pipelines``: messages
#: of 16, 128 and 256 KiB
PIPELINES = ((512, 8), (1024, 32), (1024, 64))


def pipeline_transits(schedules: tuple[str, ...] = ("gpipe", "1f1b"), iterations: int = 12,
                      pipelines: tuple[tuple[int, int], ...] = PIPELINES) -> pd.DataFrame:
    """The calibration pipeline (:mod:`executor.calibrate`'s MLP, 6 layers 3 a stage, two
    pinned ranks) at 16 micro-batches under each schedule and message size: its inputs'
    transits where the receiver was ready first, by whether the sender had gone on to
    compute (:func:`experiments.phase_errors.message_transits`, measured iterations)."""
    from executor.calibrate import _run
    from experiments.phase_errors import message_transits
    from pipesim.plan import Plan

    rows = []
    for schedule in schedules:
        for width, samples in pipelines:
            batch = 16 * samples
            job = functools.partial(builtin_job, "mlp", batch, width=width, depth=5,
                                    in_features=width)
            actions = _run(job, Plan([3, 3], 16, batch, checkpoint="never", schedule=schedule),
                           iterations, pin_cores=True)
            transits = pd.concat([message_transits(part) for it, part in
                                  actions.groupby("iteration") if it > 0], ignore_index=True)
            for computing, part in transits.groupby("sender_computing"):
                ms = 1e3 * part.transit_s
                rows.append({"schedule": schedule, "bytes": 4 * width * samples,
                             "sender_computing": bool(computing), "inputs": len(ms),
                             "median": float(ms.median()), "mean": float(ms.mean()),
                             "over_1ms": float((ms > 1.0).mean())})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", action="store_true",
                    help="instead: the calibration pipeline's transits under GPipe and 1F1B "
                    "(pipeline_transits), written as NAME_pipelines")
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--width", type=int, default=64,
                    help="the computing ranks' square matrices (64: small layers)")
    ap.add_argument("--model", default="",
                    help="the sender computes a grid's first stage of this built-in model "
                    "(experiments/validate.py's sizes) instead of small matmuls")
    ap.add_argument("--layers", type=int, default=8, help="with --model: the stage's layers")
    ap.add_argument("--samples", type=int, default=2, help="with --model: a micro-batch")
    ap.add_argument("--name", default="send_then_compute", help="the results' file name")
    ap.add_argument("--subdir", default="", help="results sub-folder (gpu on that machine)")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores: one per rank")
    if args.pipelines:
        table = pipeline_transits()
        write_results(f"{args.name}_pipelines", table, machine(), args.subdir)
        print(table.round(3).to_string(index=False))
        return
    stage = (args.model, args.layers, args.samples) if args.model else None
    parts = []
    for nbytes, count in CASES:
        items = _gather(_exchange, 2, (_free_port(), nbytes, count, args.rounds, args.width,
                                       stage),
                        expected=2, pin_cores=True)
        by_rank = {i["rank"]: i["times"] for i in items}
        part = delivery_table(by_rank[0], by_rank[1]).assign(bytes=nbytes, messages=count)
        parts.append(part)
        print(summarise(part).round(3).to_string(index=False), flush=True)
    table = summarise(pd.concat(parts, ignore_index=True))
    write_results(args.name, table, {**machine(), "rounds": args.rounds, "stage": stage,
                                               "before_s": BEFORE_S, "after_s": AFTER_S,
                                               "late_s": LATE_S, "width": args.width},
                  args.subdir)
    with pd.option_context("display.width", 160):
        print(table.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
