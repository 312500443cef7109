"""Two ranks sending to each other at once: one gloo connection against one per direction.

A 1F1B stage sends its forward output while its neighbour sends a gradient back; where
the two finish together the messages cross.  Two processes (gloo, each pinned to its own
core as the CPU grid runs them) post their receives, meet at a barrier, compute 1 ms,
then each sends ``count`` messages of ``nbytes`` to the other and waits for all of its
sends and receives.  Timed per round: the seconds inside the ``isend`` calls and from the
first post to both done.  ``one`` sends both ways over the default group (one TCP
connection per pair), ``directional`` over a group per direction
(:func:`executor.distributed.directional_groups`).

Seen on this project's 2-core VM (2026-11-24, 55 rounds, per rank; median / p90 from
post to done, rounds over 2 ms): one connection 2 x 16 KiB 0.17-0.21 / 3.0 ms (23-25),
128 KiB 0.16 / 3.9 ms (17-18), 2 x 128 KiB 2.7 / 5.3 ms (34-35), 1 MiB 2.3-2.4 / 5.4-5.5 ms
(36-38); a connection per direction 0.13-0.14 / 0.18 ms (0), 0.12-0.13 / 0.19 ms (0-1),
0.20 / 0.24-0.31 ms (0-2), 0.69-0.77 / 0.95-2.3 ms (3-6).

    python experiments/crossing_messages.py [--rounds 60] [--subdir gpu]
Writes experiments/results/crossing_messages.csv (one row per case and rank) and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist

from executor.calibrate import _gather
from executor.distributed import _free_port, directional_groups
from experiments.common import machine, write_results

#: (bytes per message, messages each way)
CASES = ((16 << 10, 2), (128 << 10, 1), (128 << 10, 2), (1 << 20, 1))
SKIPPED = 5  # first rounds: connections being set up


def _cross(rank: int, port: int, nbytes: int, count: int, directional: bool, rounds: int,
           out) -> None:
    """One rank of the crossing exchange (run under :func:`executor.calibrate._gather`,
    which pins it)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    up, down = directional_groups() if directional else (None, None)
    to_peer, from_peer = (up, down) if rank == 0 else (down, up)
    other, a = 1 - rank, torch.randn(64, 64)
    inside, total = [], []
    for r in range(rounds):
        sent = [torch.ones(nbytes // 4) for _ in range(count)]
        bufs = [torch.empty(nbytes // 4) for _ in range(count)]
        recvs = [dist.irecv(b, other, tag=r * 16 + k, group=from_peer)
                 for k, b in enumerate(bufs)]
        dist.barrier()
        start = time.perf_counter()
        while time.perf_counter() - start < 1e-3:  # compute, as a stage does before it sends
            a = torch.tanh(a @ a)
        t0 = time.perf_counter()
        sends = [dist.isend(s, other, tag=r * 16 + k, group=to_peer) for k, s in enumerate(sent)]
        t1 = time.perf_counter()
        for work in recvs + sends:
            work.wait()
        if r >= SKIPPED:
            inside.append(t1 - t0)
            total.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    out.put({"rank": rank, "isend_ms": 1e3 * statistics.median(inside),
             "isend_max_ms": 1e3 * max(inside), "done_ms": 1e3 * statistics.median(total),
             "done_p90_ms": 1e3 * sorted(total)[int(0.9 * len(total))],
             "over_2ms": sum(t > 2e-3 for t in total), "rounds": len(total)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--subdir", default="", help="results sub-folder (gpu on that machine)")
    args = ap.parse_args()
    if args.rounds <= SKIPPED:
        ap.error(f"--rounds {args.rounds}: the first {SKIPPED} rounds set connections up and "
                 "are not timed; give more")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores: one per rank")
    rows = []
    for nbytes, count in CASES:
        for directional in (False, True):  # side by side, case by case
            items = _gather(_cross, 2, (_free_port(), nbytes, count, directional, args.rounds),
                            expected=2, pin_cores=True)
            for item in sorted(items, key=lambda i: i["rank"]):
                rows.append({"bytes": nbytes, "messages": count,
                             "connections": "directional" if directional else "one", **item})
                print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    write_results("crossing_messages", table, {**machine(), "rounds": args.rounds},
                  args.subdir)
    with pd.option_context("display.width", 160):
        print(table.groupby(["bytes", "messages", "connections"])
              [["isend_ms", "done_ms", "done_p90_ms", "over_2ms"]].median().round(3).to_string())


if __name__ == "__main__":
    main()
