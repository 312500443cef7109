"""What the host-contention calibration reads: ranks slowing each other, or the waits.

``executor.calibrate.measure_contention`` times a small model's forward+backward on each
rank alone (the others parked at a barrier) and on all ranks at once, each step of the
latter followed by a message passed round a ring.  So a "together" step comes after a
blocking wait for a message and an "alone" step after another step: the figure mixes what
a busy neighbour costs with what a wait costs the step after it (on this VM an action
after a 0.3-3 ms wait runs 1.06-1.32x its hot pace, ``experiments/action_costs.py``).

This measures the two apart, side by side, in one pair of pinned ranks:

* ``ring`` -- the calibration's own protocol (alone: hot steps; together: steps with the
  ring's message after each);
* ``echo`` -- the same, but alone a rank also passes its message after every step, to the
  other rank, which does not compute and sends it straight back: alone and together
  then wait alike, and what is left is the neighbour's computing;
* ``hot`` -- no messages at all, alone and together: the neighbour's computing on hot
  steps.

    python experiments/contention_waits.py [--rounds 5] [--steps 10] [--iterations 200]
Writes experiments/results/contention_waits.csv (one row per round and protocol) and
.json (medians per protocol).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist

from executor.calibrate import CALIBRATION_JOB, _gather
from executor.distributed import _free_port, directional_groups
from executor.host_allocator import retain_freed_memory
from executor.transport import message_group
from experiments.common import machine, write_results

PROTOCOLS = ("ring", "echo", "hot")


def _loop(rank: int, barrier, rounds: int, steps: int, port: int, job, out) -> None:
    """Two ranks; per round and protocol, each rank alone in turn then both together,
    ``steps`` timed forward+backward steps in each phase (see the module doc)."""
    torch.set_num_threads(1)
    retain_freed_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    groups = directional_groups()
    module, loss_fn, x, y = job()
    message, inbox = torch.randn(8, 256), torch.empty(8, 256)
    peer = 1 - rank

    def exchange() -> None:
        works = [dist.isend(message, peer, group=message_group(groups, rank, peer)),
                 dist.irecv(inbox, peer, group=message_group(groups, peer, rank))]
        for work in works:
            if work is not None:
                work.wait()

    def echo() -> None:  # the idle rank: the message back as soon as it comes
        dist.recv(inbox, peer, group=message_group(groups, peer, rank))
        dist.send(inbox, peer, group=message_group(groups, rank, peer))

    for _ in range(5):
        loss_fn(module(x), y).backward()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for protocol in PROTOCOLS:
            for phase in (0, 1, 2):  # 0, 1: that rank alone; 2: both
                barrier.wait()
                computing = phase in (rank, 2)
                if not computing:
                    if protocol == "echo":
                        for _ in range(steps):
                            echo()
                    continue
                key = (protocol, "together" if phase == 2 else "alone")
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss_fn(module(x), y).backward()
                    times.setdefault(key, []).append(time.perf_counter() - t0)
                    if phase == 2 and protocol in ("ring", "echo"):
                        exchange()
                    elif protocol == "echo":  # alone: a round trip to the idle rank
                        works = [dist.isend(message, peer,
                                            group=message_group(groups, rank, peer))]
                        dist.recv(inbox, peer, group=message_group(groups, peer, rank))
                        for work in works:
                            if work is not None:
                                work.wait()
    out.put((rank, {f"{p}|{k}": statistics.median(v) for (p, k), v in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="measurements, one after another")
    ap.add_argument("--steps", type=int, default=10, help="steps a phase")
    ap.add_argument("--iterations", type=int, default=200, help="steps of each kind a round")
    args = ap.parse_args()
    import multiprocessing as mp

    rows = []
    for r in range(args.rounds):
        barrier = mp.get_context("spawn").Barrier(2)
        got = _gather(_loop, 2, (barrier, max(1, args.iterations // args.steps), args.steps,
                                 _free_port(), CALIBRATION_JOB), expected=2, pin_cores=True)
        for protocol in PROTOCOLS:
            alone = statistics.median(m[f"{protocol}|alone"] for _, m in got)
            together = statistics.median(m[f"{protocol}|together"] for _, m in got)
            rows.append({"round": r, "protocol": protocol, "alone_ms": 1e3 * alone,
                         "together_ms": 1e3 * together,
                         "contention": together / alone - 1.0})
        print(pd.DataFrame(rows[-len(PROTOCOLS):]).round(4).to_string(index=False), flush=True)
    table = pd.DataFrame(rows)
    medians = table.groupby("protocol").contention.median().to_dict()
    write_results("contention_waits", table, {**machine(), "medians": medians,
                                               "rounds": args.rounds, "steps": args.steps})
    print("median contention by protocol:", {k: round(v, 4) for k, v in medians.items()})


if __name__ == "__main__":
    main()
