"""Does a wait cost more when the neighbour computes through it?

The idle costs (``executor.in_place.idle_costs``) are measured with each stage alone: its
rank sleeps, the other rank is quiet.  In a pipeline the other rank computes through the
wait -- on a machine whose cores share the last-level cache it streams its own weights,
activations and gradients through that cache meanwhile.  Here one stage's step (forward,
a wait, backward: the backward timed) runs on its pinned core, and during the wait the
other core either sleeps or runs the other stage's forward and backward over and over::

    quiet      rank 0  |F|----- idle -----|B..|      rank 1  (sleeps)
    busy       rank 0  |F|----- idle -----|B.....|   rank 1  |F|B|F|B|F|B|F|B|F|B|

The layers are the CPU grid's MLP (``validate.py``'s sizes) split as ``--balance``; the
stage timed is ``--stage`` (0: the first), the neighbour the other one.  Alternated within
each round, medians over rounds.

    python experiments/neighbour_idle.py [--balance 1,7] [--stage 0] [--sizes 2,8,32]
        [--idle-ms 2,10] [--rounds 40]
Writes experiments/results/neighbour_idle_BALANCE_stageS.csv and .json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from experiments.common import machine, write_results


def _stage(balance: list[int], stage: int, size: int):
    """The layers of ``stage`` (the CPU grid's MLP), its input and output gradient."""
    import torch

    from executor.models import builtin_job
    from experiments.validate import MODELS

    module, _, x, _ = builtin_job("mlp", 32, **MODELS["mlp"])
    first = sum(balance[:stage])
    layers = torch.nn.Sequential(*list(module)[first:first + balance[stage]])
    with torch.no_grad():
        h = torch.nn.Sequential(*list(module)[:first])(x[:size]) if first else x[:size]
    h = h.detach().requires_grad_(first > 0)
    grad = torch.randn_like(layers(h))
    return layers, h, grad


def _neighbour(balance: list[int], stage: int, size: int, core: int, busy, stop) -> None:
    """The other stage's forward and backward over and over while ``busy`` is set."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    layers, h, grad = _stage(balance, stage, size)
    while not stop.is_set():
        if busy.is_set():
            layers(h).backward(grad)
        else:
            time.sleep(0.0005)


def measure(balance: list[int], stage: int, sizes: list[int], idles: list[float],
            rounds: int) -> pd.DataFrame:
    """Median backward seconds of ``stage`` after each idle, the neighbour quiet or busy
    (and with no idle, the step's steady pace), per size."""
    import torch

    from executor.host_allocator import retain_freed_memory

    retain_freed_memory()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    other = 1 - stage if len(balance) == 2 else (stage + 1) % len(balance)
    ctx = mp.get_context("spawn")
    rows = []
    for size in sizes:
        busy, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_neighbour, args=(balance, other, size, 1, busy, stop),
                           daemon=True)
        proc.start()
        layers, h, grad = _stage(balance, stage, size)
        for _ in range(20):  # warm
            layers(h).backward(grad)
        times: dict[tuple[str, float], list[float]] = {}
        for _ in range(rounds):
            for neighbour in ("quiet", "busy"):
                for idle in (0.0, *idles):
                    out = layers(h)
                    if neighbour == "busy":
                        busy.set()
                    if idle:
                        time.sleep(idle)
                    else:  # the steady pace: the step right after the last
                        pass
                    t0 = time.perf_counter()
                    out.backward(grad)
                    times.setdefault((neighbour, idle), []).append(time.perf_counter() - t0)
                    busy.clear()
                    time.sleep(0.002)  # the neighbour's step ends before the next one
        stop.set()
        proc.join(timeout=60)
        for (neighbour, idle), ts in times.items():
            rows.append({"balance": ",".join(map(str, balance)), "stage": stage, "size": size,
                         "neighbour": neighbour, "idle_ms": 1e3 * idle,
                         "backward_ms": 1e3 * statistics.median(ts), "rounds": len(ts)})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--balance", default="1,7")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--sizes", default="2,8,32")
    ap.add_argument("--idle-ms", default="2,10")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("neighbour_idle needs two cores")
    table = measure([int(b) for b in args.balance.split(",")], args.stage,
                    [int(s) for s in args.sizes.split(",")],
                    [float(i) / 1e3 for i in args.idle_ms.split(",")], args.rounds)
    wide = table.pivot_table(index=["size", "idle_ms"], columns="neighbour",
                             values="backward_ms")
    wide["busy_over_quiet"] = wide["busy"] / wide["quiet"]
    print(f"stage {args.stage} of [{args.balance}], backward ms (medians of {args.rounds})")
    print(wide.round(3).to_string())
    name = f"neighbour_idle_{args.balance.replace(',', '_')}_stage{args.stage}"
    path = write_results(name, table, {**machine(), **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
