"""Does sending a message slow the sender's next action?

In GPipe's backward phase the last stage runs its backwards back to back, each sending its
input's gradient to the stage before; half or more of GPT's and U-Net's start late and run
slower, mostly where the receive was already posted, so that gloo writes the message from
the sender's own thread (``experiments/action_costs.py``, ``late_backwards``).  Here rank 1
runs two forwards, then two backwards (the second timed, and the gap before it), sending
``--bytes`` to rank 0 between them, which has posted its receive before (``posted``: the
sender writes it) or posts it 0.3 ms into the second backward (``later``: gloo's threads
write it meanwhile), and waits asleep or computes meanwhile (``--busy``); ``none`` sends
nothing::

    rank 1   |F1|F2|B1|send|  B2 (timed)  |
    posted   rank 0  recv posted ......... received
    later    rank 0  ............ recv posted . received

The conditions alternate within each round; medians over rounds.

    python experiments/send_after.py [--bytes 8192,65536,262144] [--size 8] [--rounds 100]
Writes experiments/results/send_after.csv and .json.
"""

from __future__ import annotations

import argparse
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

NONE, POSTED, LATER = "none", "posted", "later"
#: how far into rank 1's second backward rank 0 posts its receive (``later``)
LATER_S = 0.3e-3
#: how long rank 0 computes before it waits (``--busy``): past rank 1's four actions
BUSY_S = 4e-3


def _spin(seconds: float, a: torch.Tensor) -> torch.Tensor:
    """Compute (small matrix products) for ``seconds``."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        a = torch.tanh(a @ a)
    return a


def _trials(rank: int, port: int, width: int, depth: int, size: int,
            sizes_bytes: tuple[int, ...], busy: bool, rounds: int, out) -> None:
    """Rank 1 puts rows ``(bytes, condition, gap_s, backward_s)``."""
    gloo_rank(rank, port)
    stage = hidden_layers(width, depth)
    trials = [(0, NONE)] + [(b, c) for b in sizes_bytes for c in (POSTED, LATER)]
    bufs = {b: torch.zeros(max(b // 4, 1)) for b in sizes_bytes}
    a = torch.randn(64, 64) * 0.01
    rows, tag = [], 0
    for r in range(rounds + 3):
        for nbytes, cond in trials:
            tag += 1
            if rank == 0:
                work = None
                if cond == POSTED:
                    work = _work(dist.irecv(bufs[nbytes], 1, tag=tag))
                dist.barrier()
                if cond == LATER:
                    # rank 1's two forwards and first backward, then a little of the second
                    _work(dist.irecv(torch.zeros(1), 1, tag=10**7 + tag)).wait()
                    time.sleep(LATER_S)
                    work = _work(dist.irecv(bufs[nbytes], 1, tag=tag))
                if busy:  # through rank 1's forwards and backwards (gloo's work is
                    a = _spin(BUSY_S, a)  # done only once waited on)
                if work is not None:
                    work.wait()
                dist.barrier()
                continue
            x1, x2 = torch.randn(size, width), torch.randn(size, width)
            grad = torch.randn(size, width)
            dist.barrier()
            y1, y2 = stage(x1), stage(x2)
            y1.backward(grad)
            ended = time.perf_counter()
            if cond == LATER:
                _work(dist.isend(torch.zeros(1), 0, tag=10**7 + tag)).wait()
            send = _work(dist.isend(bufs[nbytes], 0, tag=tag)) if cond != NONE else None
            began = time.perf_counter()
            y2.backward(grad)
            done = time.perf_counter()
            if send is not None:
                send.wait()
            dist.barrier()
            if r >= 3:
                rows.append((nbytes, cond, began - ended, done - began))
    if rank == 1:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="8192,65536,262144")
    ap.add_argument("--size", type=int, default=8, help="samples of each micro-batch")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--busy", action="store_true",
                    help="rank 0 computes for BUSY_S before it waits for the message")
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    sizes = tuple(int(b) for b in args.bytes.split(","))
    (rows,) = _gather(_trials, 2, (_free_port(), args.width, args.depth, args.size, sizes,
                                   args.busy, args.rounds), expected=1, pin_cores=True)
    raw = pd.DataFrame(rows, columns=["bytes", "condition", "gap_s", "backward_s"])
    table = (raw.groupby(["bytes", "condition"])
             .agg(gap_ms=("gap_s", "median"), backward_ms=("backward_s", "median"),
                  trials=("backward_s", "size")).reset_index())
    table[["gap_ms", "backward_ms"]] *= 1e3
    alone = table[table.condition == NONE].backward_ms.iloc[0]
    table["over_none_ms"] = table.backward_ms - alone
    with pd.option_context("display.width", 160):
        print(table.round(3).to_string(index=False))
    write_results("send_after" + ("_busy" if args.busy else ""), table, {
        **machine(), "width": args.width, "depth": args.depth, "size": args.size,
        "bytes": args.bytes, "busy": args.busy, "rounds": args.rounds, "later_s": LATER_S,
        "busy_s": BUSY_S})


if __name__ == "__main__":
    main()
