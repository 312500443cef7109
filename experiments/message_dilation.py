"""Does a neighbour's messages slow a rank's actions?  One stage in place, quiet and messaging.

Inside a running pipeline an action costs more than the same stage's steps back to back
(``in_place_costs.py``: the grid's lone actions 1.03-1.36x their in-place seconds).  One
candidate is gloo: a rank pinned to one core receives its next input, posted ahead,
on a gloo thread that shares that core with the action computing.  Two pinned ranks,
each in turn running its stage's in-place step (:func:`executor.in_place._stage_step`:
the executor's StageRunner, neighbours synthesised) while the other

* ``quiet``: waits at a barrier;
* ``messages``: echoes as a pipeline neighbour that computes nothing -- the stepping rank
  posts a receive before each step and sends a boundary-sized tensor after it; the
  neighbour sends its tensor at once, so it arrives *during* the step::

      stepping rank   post irecv |F====|B========| isend
      neighbour       isend ---> (lands while F runs)  irecv

and prints each rank's median F and B, quiet -> messaging.  Nothing is fitted: a
measurement of what a message arriving mid-action costs that action.

    python experiments/message_dilation.py [--model mlp] [--balance 4,4] [--sizes 2,8]
Writes experiments/results/message_dilation_MODEL.csv.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd
import torch
import torch.distributed as dist

from experiments.common import machine, write_results

MODES = ("quiet", "messages")


def _loop(rank: int, port: int, job, balance: list[int], size: int, steps: int, rounds: int,
          out) -> None:
    """Rank ``rank``'s side: puts ``(rank, {mode: {"F": s, "B": s}})``, median seconds."""
    from executor.host_allocator import retain_freed_memory
    from executor.in_place import _stage_step
    from executor.microbatch import scatter
    from executor.partition import split_module
    from pipesim.plan import Plan

    torch.set_num_threads(1)
    retain_freed_memory()  # the pipelines' allocator policy
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    step = _stage_step(job, balance, rank, size)
    for _ in range(5):  # warm-up
        step()
    module, _, x, _ = job()
    plan = Plan(balance, 1, size)
    with torch.no_grad():  # the boundary tensor: stage 0's output
        boundary = split_module(module, balance)[0](scatter(x[:size], plan)[0]).detach()
    times: dict[str, dict[str, list[float]]] = {m: {"F": [], "B": []} for m in MODES}
    other = 1 - rank
    for _ in range(rounds):
        for mode in MODES:
            for turn in (0, 1):
                dist.barrier()
                if turn == rank:
                    for i in range(steps):
                        work = (dist.irecv(torch.empty_like(boundary), other, tag=2 * i + 1)
                                if mode == "messages" else None)
                        for kind, seconds in step().items():
                            times[mode][kind].append(seconds)
                        if work is not None:
                            dist.isend(boundary, other, tag=2 * i).wait()
                            work.wait()
                elif mode == "messages":  # the echoing neighbour, computing nothing
                    for i in range(steps):
                        got = dist.irecv(torch.empty_like(boundary), turn, tag=2 * i)
                        sent = dist.isend(boundary, turn, tag=2 * i + 1)
                        got.wait()
                        sent.wait()
    out.put((rank, {m: {k: statistics.median(v) for k, v in kinds.items()}
                    for m, kinds in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from executor.calibrate import _gather
    from executor.distributed import _free_port
    from executor.models import builtin_job
    from experiments.validate import BATCH, MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--balance", default="4,4")
    ap.add_argument("--sizes", default="2,8")
    ap.add_argument("--steps", type=int, default=30, help="steps a turn")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    balance = [int(b) for b in args.balance.split(",")]
    if len(balance) != 2:
        ap.error(f"--balance needs two stages, got {balance}")
    job = functools.partial(builtin_job, args.model, BATCH, **MODELS[args.model])
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        got = dict(_gather(_loop, 2, (_free_port(), job, balance, size, args.steps,
                                      args.rounds), expected=2, pin_cores=True))
        for rank in (0, 1):
            q, m = got[rank]["quiet"], got[rank]["messages"]
            rows.append({"model": args.model, "balance": args.balance, "micro_batch": size,
                         "rank": rank, **{f"{k}_{mode}_s": got[rank][mode][k]
                                          for mode in MODES for k in ("F", "B")}})
            print(f"{args.model} {balance} size {size} rank {rank}: F {q['F'] * 1e3:.3f} -> "
                  f"{m['F'] * 1e3:.3f} ms, B {q['B'] * 1e3:.3f} -> {m['B'] * 1e3:.3f} ms",
                  flush=True)
    path = write_results(f"message_dilation_{args.model}", pd.DataFrame(rows),
                         {**machine(), "steps": args.steps, "rounds": args.rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
