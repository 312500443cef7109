"""Does a message reach a waiting receiver later when its sender computes right after it?

In GPipe's phases a stage sends and goes straight on to its next action; in 1F1B's it
more often waits for its next input.  Pooled over the committed CPU grids, a U-Net
message (128 KiB and up) whose receiver was already waiting took 0.38 ms from post to
receipt at the median and 1.2 ms on average where its sender had started computing
before the receipt, against 0.14 / 0.31 ms where it had not (GPipe [8,5] at 16
micro-batches, 2026-11-27).  Here two ranks pinned to a core each (gloo, a process group
per direction, as the executor sends) isolate that: each round rank 1 waits for rank 0's
``count`` messages of ``nbytes``, its receives posted before the send (``ahead``, as the
executor posts them while the action before runs) or 0.5 ms after it (``late``: gloo
then writes the bytes from the sender's I/O thread once the receive is posted), and rank
0 computes 1 ms, sends, then computes 2 ms (``compute``) or sleeps as long (``sleep``)::

    rank 0   |compute 1 ms| isend x count |compute 2 ms ......|      (or sleep 2 ms)
    rank 1        receives posted (ahead) ... wait .......^ received  (late: posted
                                                                    0.5 ms after the send)

The delivery is timed from the send's post to the last receive's return (both ranks read
one monotonic clock).  The four conditions alternate within each round; medians, means
and 90th percentiles over rounds.

    python experiments/send_then_compute.py [--rounds 80] [--subdir gpu]
Writes experiments/results/send_then_compute.csv (one row per case and condition) and .json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from executor.calibrate import _gather
from executor.distributed import _free_port, directional_groups
from executor.transport import _work
from experiments.common import machine, write_results

#: (bytes per message, messages per round): the CPU grid's GPT (32 KiB) and U-Net (128 KiB
#: and up, two a step: its output and a skip) messages at 8-16 micro-batches
CASES = ((32 << 10, 2), (128 << 10, 1), (128 << 10, 2), (512 << 10, 2))
#: (receive posted, what the sender does after sending), alternated within each round
CONDITIONS = (("ahead", "compute"), ("ahead", "sleep"), ("late", "compute"), ("late", "sleep"))
SKIPPED = 5  # first rounds: connections being set up
BEFORE_S, AFTER_S, LATE_S = 1e-3, 2e-3, 0.5e-3


def _spin(seconds: float, a: torch.Tensor) -> torch.Tensor:
    """Compute for ``seconds`` (small matmuls, as a stage's layers)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh(a @ a)
    return a


def _exchange(rank: int, port: int, nbytes: int, count: int, rounds: int, width: int,
              out) -> None:
    """One rank of the exchange (run under :func:`executor.calibrate._gather`, which pins
    it): per round and condition, rank 0 reports when it posted its sends, rank 1 when the
    last message was in."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    up, _down = directional_groups()  # rank 0 -> 1 over ``up``, as the executor's forwards
    a = torch.randn(width, width) / width ** 0.5
    times: list[tuple[int, str, str, float]] = []
    tag = 0
    for r in range(rounds):
        for posted, after in CONDITIONS:
            tag += 1
            if rank == 0:
                sent = [torch.ones(nbytes // 4) for _ in range(count)]
                dist.barrier()
                a = _spin(BEFORE_S, a)
                t_post = time.perf_counter()
                works = [_work(dist.isend(s, 1, tag=tag * 8 + k, group=up))
                         for k, s in enumerate(sent)]
                if after == "compute":
                    a = _spin(AFTER_S, a)
                else:
                    time.sleep(AFTER_S)
                for w in works:
                    w.wait()
                times.append((r, posted, after, t_post))
            else:
                bufs = [torch.empty(nbytes // 4) for _ in range(count)]
                if posted == "ahead":
                    works = [_work(dist.irecv(b, 0, tag=tag * 8 + k, group=up))
                             for k, b in enumerate(bufs)]
                dist.barrier()
                if posted == "late":
                    # the sender posts after BEFORE_S; post ours LATE_S after that
                    time.sleep(BEFORE_S + LATE_S)
                    works = [_work(dist.irecv(b, 0, tag=tag * 8 + k, group=up))
                             for k, b in enumerate(bufs)]
                for w in works:
                    w.wait()
                times.append((r, posted, after, time.perf_counter()))
            dist.barrier()  # both done before the next condition
    dist.destroy_process_group()
    out.put({"rank": rank, "times": times})


def delivery_table(sender: list[tuple], receiver: list[tuple]) -> pd.DataFrame:
    """Per round and condition, the seconds from the sender's post to the receiver
    holding the last message (``delivery_ms``), rounds before :data:`SKIPPED` left out."""
    posts = {(r, p, a): t for r, p, a, t in sender}
    rows = [{"round": r, "posted": p, "after": a, "delivery_ms": 1e3 * (t - posts[(r, p, a)])}
            for r, p, a, t in receiver if (r, p, a) in posts and r >= SKIPPED]
    return pd.DataFrame(rows)


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Median, mean, 90th percentile (ms) and the share over 1 ms per case and condition."""
    def over(x: pd.Series) -> float:
        return float((x > 1.0).mean())

    return (table.groupby(["bytes", "messages", "posted", "after"]).delivery_ms
            .agg(rounds="size", median="median", mean="mean",
                 p90=lambda x: float(np.quantile(x, 0.9)), over_1ms=over).reset_index())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--width", type=int, default=64,
                    help="the computing ranks' square matrices (64: small layers)")
    ap.add_argument("--subdir", default="", help="results sub-folder (gpu on that machine)")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores: one per rank")
    parts = []
    for nbytes, count in CASES:
        items = _gather(_exchange, 2, (_free_port(), nbytes, count, args.rounds, args.width),
                        expected=2, pin_cores=True)
        by_rank = {i["rank"]: i["times"] for i in items}
        part = delivery_table(by_rank[0], by_rank[1]).assign(bytes=nbytes, messages=count)
        parts.append(part)
        print(summarise(part).round(3).to_string(index=False), flush=True)
    table = summarise(pd.concat(parts, ignore_index=True))
    write_results("send_then_compute", table, {**machine(), "rounds": args.rounds,
                                               "before_s": BEFORE_S, "after_s": AFTER_S,
                                               "late_s": LATE_S, "width": args.width},
                  args.subdir)
    with pd.option_context("display.width", 160):
        print(table.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
