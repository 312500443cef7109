"""Does an action after a blocked receive cost what it costs after a sleep as long?

The idle costs (``executor.in_place.idle_costs``) are measured with the rank *sleeping*
before its action (``time.sleep``); in a pipeline it *blocks* on a gloo receive until the
neighbour's message arrives.  Pooled over the committed grids, the actions after a wait of
0.3-3 ms ran 0.05-0.3 ms over their seconds alone plus that curve (2026-11-27), where
those after more than 3 ms matched it.  Here rank 1 runs one stage's forward and backward
(the CPU grid's MLP, ``--width``, ``--depth`` layers, ``--sizes`` samples) on its pinned
core, and before the timed action (``F`` or ``B``) it either goes on at once (hot),
sleeps, or blocks on a message rank 0 sends that long after it asks (rank 0 is told by a
message, and sleeps that long: rank 1 times the wait it really had)::

    hot     rank 1  |F|B|
    sleep   rank 1  |F|-- sleep --|B....|
    recv    rank 1  |F|-- blocked on irecv --|B....|     rank 0  ..wait|sleep|send|

The conditions alternate within each round; medians over rounds.

    python experiments/blocked_wait.py [--idle-ms 0.5,2] [--sizes 2,8] [--rounds 150]
Writes experiments/results/blocked_wait.csv and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
import torch.distributed as dist

from executor.calibrate import _gather
from executor.distributed import _free_port
from executor.transport import _work
from experiments.common import gloo_rank, hidden_layers, machine, write_results

HOT, SLEEP, RECV = "hot", "sleep", "recv"


def _wait(cond: str, idle: float, tag: int, ask: torch.Tensor, msg: torch.Tensor) -> float:
    """Rank 1's wait before its timed action (seconds it really lasted): none, a sleep of
    ``idle``, or a receive it blocks on, asked of rank 0 by a message (tag ``tag``)."""
    began = time.perf_counter()
    if cond == SLEEP:
        time.sleep(idle)
    elif cond == RECV:
        work = _work(dist.irecv(msg, 0, tag=tag + 1))
        _work(dist.isend(ask, 0, tag=tag)).wait()
        work.wait()
    return time.perf_counter() - began


def _trials(rank: int, port: int, width: int, depth: int, sizes: tuple[int, ...],
            idles: tuple[float, ...], rounds: int, out) -> None:
    """Rank 1 times each (kind, size, condition, idle) trial's action; rank 0 sends the
    messages it blocks on.  Rank 1 puts rows ``(kind, size, condition, idle_s, waited_s,
    action_s)``."""
    gloo_rank(rank, port)
    stage = hidden_layers(width, depth)
    trials = [(kind, size, cond, idle) for kind in ("F", "B") for size in sizes
              for cond, idle in ((HOT, 0.0), *((c, i) for c in (SLEEP, RECV) for i in idles))]
    ask, msg = torch.zeros(1), torch.zeros(2, width)
    rows, tag = [], 0
    for r in range(rounds + 3):  # the first rounds warm gloo and the allocator up
        for kind, size, cond, idle in trials:
            tag += 2
            if rank == 0:
                if cond == RECV:
                    _work(dist.irecv(ask, 1, tag=tag)).wait()
                    time.sleep(idle)
                    _work(dist.isend(msg, 1, tag=tag + 1)).wait()
                continue
            x = torch.randn(size, width, requires_grad=kind == "F")
            grad = torch.randn(size, width)

            if kind == "F":
                # a backward before, as 1F1B's forward follows one
                stage(torch.randn(size, width)).backward(grad)
                waited = _wait(cond, idle, tag, ask, msg)
                t0 = time.perf_counter()
                y = stage(x)
                seconds = time.perf_counter() - t0
                y.backward(grad)
            else:
                y = stage(x)
                waited = _wait(cond, idle, tag, ask, msg)
                t0 = time.perf_counter()
                y.backward(grad)
                seconds = time.perf_counter() - t0
            if r >= 3:
                rows.append((kind, size, cond, idle, waited, seconds))
    if rank == 1:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-ms", default="0.5,2")
    ap.add_argument("--sizes", default="2,8")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args()
    idles = tuple(float(i) / 1e3 for i in args.idle_ms.split(","))
    sizes = tuple(int(s) for s in args.sizes.split(","))
    (rows,) = _gather(_trials, 2, (_free_port(), args.width, args.depth, sizes, idles,
                                   args.rounds), expected=1, pin_cores=True)
    raw = pd.DataFrame(rows, columns=["kind", "size", "condition", "idle_s", "waited_s",
                                      "action_s"])
    table = (raw.groupby(["kind", "size", "condition", "idle_s"])
             .agg(action_ms=("action_s", "median"), waited_ms=("waited_s", "median"),
                  trials=("action_s", "size")).reset_index())
    table[["action_ms", "waited_ms"]] *= 1e3
    hot = table[table.condition == HOT].set_index(["kind", "size"]).action_ms
    table["over_hot_ms"] = table.action_ms - [hot[(k, s)] for k, s in zip(table.kind, table["size"],
                                                                         strict=True)]
    with pd.option_context("display.width", 160):
        print(table.round(3).to_string(index=False))
    # the recv over the sleep of the same idle: what blocking costs beyond sleeping
    paired = table[table.condition != HOT].pivot_table(
        index=["kind", "size", "idle_s"], columns="condition", values="action_ms")
    diff = (paired[RECV] - paired[SLEEP]).rename("recv_minus_sleep_ms").reset_index()
    print(diff.round(3).to_string(index=False))
    write_results("blocked_wait", table, {
        **machine(), "width": args.width, "depth": args.depth, "sizes": args.sizes,
        "idle_ms": args.idle_ms, "rounds": args.rounds,
        "recv_minus_sleep_ms": statistics.median(diff.recv_minus_sleep_ms.tolist())})


if __name__ == "__main__":
    main()
