"""Does a wait cost more when the neighbour computes through it?

The idle costs (``executor.in_place.idle_costs``) are measured with each stage alone: its
rank sleeps, the other rank is quiet.  In a pipeline the other rank computes through the
wait -- on a machine whose cores share the last-level cache it streams its own weights,
activations and gradients through that cache meanwhile.  Here one stage's step (forward,
a wait, backward: the backward timed) runs on its pinned core, and during the wait the
other core either sleeps or runs the other stage's forward and backward over and over::

    quiet      rank 0  |F|----- idle -----|B..|      rank 1  (sleeps)
    busy       rank 0  |F|----- idle -----|B.....|   rank 1  |F|B|F|B|F|B|F|B|F|B|

The layers are one of the CPU grid's models (``--model``, ``validate.py``'s sizes) split
as ``--balance`` (GPT's stages as ``nn.Sequential`` slices; U-Net's skips need the
executor, so it is not offered); the stage timed is ``--stage`` (0: the first), the
neighbour the other one.  Alternated within each round, medians over rounds.

With ``--before F`` the wait comes before the forward instead, and the forward and the
backward right after it are both timed: whether a wait slows more than the one action
after it (a balanced pipeline at one micro-batch: each rank sleeps 15-55 ms while the
other computes, then runs its forward and backward).  With ``--busy wait`` the neighbour
computes during the wait only, stopping as the timed action starts (it finishes the step
it is in: ``--neighbour-size`` keeps its steps short), as a pipeline's neighbour does
once it has sent what the rank waits for; by default (``all``) it computes through the
timed actions too.

    python experiments/neighbour_idle.py [--model mlp] [--balance 1,7] [--stage 0]
        [--sizes 2,8,32] [--idle-ms 2,10] [--rounds 40] [--before B] [--busy all]
        [--neighbour-size N]
Writes experiments/results/neighbour_idle_BALANCE_stageS.csv and .json (MLP's), or
neighbour_idle_MODEL_BALANCE_stageS.csv and .json.
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


def _stage(model: str, balance: list[int], stage: int, size: int):
    """The layers of ``stage`` (of the CPU grid's ``model``), its input and output
    gradient."""
    import torch

    from executor.models import builtin_job
    from experiments.validate import MODELS

    module, _, x, _ = builtin_job(model, 32, **MODELS[model])
    first = sum(balance[:stage])
    layers = torch.nn.Sequential(*list(module)[first:first + balance[stage]])
    with torch.no_grad():
        h = torch.nn.Sequential(*list(module)[:first])(x[:size]) if first else x[:size]
    h = h.detach().requires_grad_(first > 0 and h.is_floating_point())
    grad = torch.randn_like(layers(h))
    return layers, h, grad


def _neighbour(model: str, balance: list[int], stage: int, size: int, core: int, busy,
               stop) -> None:
    """The other stage's forward and backward over and over while ``busy`` is set."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    layers, h, grad = _stage(model, balance, stage, size)
    while not stop.is_set():
        if busy.is_set():
            layers(h).backward(grad)
        else:
            time.sleep(0.0005)


def _wait(busy, busy_now: bool, idle: float, stop_after: bool) -> None:
    """The rank's wait of ``idle`` seconds, the neighbour computing through it where
    ``busy_now`` (and stopped as it ends where ``stop_after``)."""
    if busy_now:
        busy.set()
    time.sleep(idle)
    if stop_after:
        busy.clear()


def measure(balance: list[int], stage: int, sizes: list[int], idles: list[float],
            rounds: int, model: str = "mlp", before: str = "B", busy_during: str = "all",
            neighbour_size: int = 0) -> pd.DataFrame:
    """Median backward seconds of ``stage`` after each idle (``before="F"``: the idle
    before the forward, and the forward's median seconds too), the neighbour quiet or busy
    (through the timed actions, or with ``busy_during="wait"`` during the idle only; its
    steps on ``neighbour_size`` samples, 0: the timed stage's size), and with no idle the
    step's steady pace, per size."""
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
        proc = ctx.Process(target=_neighbour, args=(model, balance, other,
                                                    neighbour_size or size, 1, busy, stop),
                           daemon=True)
        proc.start()
        layers, h, grad = _stage(model, balance, stage, size)
        for _ in range(20):  # warm
            layers(h).backward(grad)
        times: dict[tuple[str, float], list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for neighbour in ("quiet", "busy"):
                for idle in (0.0, *idles):
                    # (no idle: the step right after the last, the steady pace)
                    busy_now, stop_after = neighbour == "busy", busy_during == "wait"
                    if before == "F":
                        _wait(busy, busy_now, idle, stop_after)
                    t0 = time.perf_counter()
                    out = layers(h)
                    t1 = time.perf_counter()
                    if before == "B":  # the neighbour starts after the forward
                        _wait(busy, busy_now, idle, stop_after)
                        t1 = time.perf_counter()
                    out.backward(grad)
                    t2 = time.perf_counter()
                    times.setdefault((neighbour, idle), []).append((t1 - t0, t2 - t1))
                    busy.clear()
                    time.sleep(0.002)  # the neighbour's step ends before the next one
        stop.set()
        proc.join(timeout=60)
        for (neighbour, idle), ts in times.items():
            rows.append({"model": model, "balance": ",".join(map(str, balance)),
                         "stage": stage, "size": size, "neighbour": neighbour,
                         "idle_ms": 1e3 * idle, "before": before, "busy_during": busy_during,
                         "forward_ms": 1e3 * statistics.median(f for f, _ in ts),
                         "backward_ms": 1e3 * statistics.median(b for _, b in ts),
                         "rounds": len(ts)})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=("mlp", "gpt"))
    ap.add_argument("--balance", default="1,7")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--sizes", default="2,8,32")
    ap.add_argument("--idle-ms", default="2,10")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--before", default="B", choices=("B", "F"),
                    help="the action the wait comes before (F: the forward and backward timed)")
    ap.add_argument("--busy", default="all", choices=("all", "wait"),
                    help="when the busy neighbour computes: through the timed actions too, "
                         "or during the wait only")
    ap.add_argument("--neighbour-size", type=int, default=0,
                    help="samples of the neighbour's steps (0: the timed stage's size)")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("neighbour_idle needs two cores")
    table = measure([int(b) for b in args.balance.split(",")], args.stage,
                    [int(s) for s in args.sizes.split(",")],
                    [float(i) / 1e3 for i in args.idle_ms.split(",")], args.rounds, args.model,
                    args.before, args.busy, args.neighbour_size)
    timed = ("forward_ms", "backward_ms") if args.before == "F" else ("backward_ms",)
    for what in timed:
        wide = table.pivot_table(index=["size", "idle_ms"], columns="neighbour", values=what)
        wide["busy_over_quiet"] = wide["busy"] / wide["quiet"]
        print(f"{args.model} stage {args.stage} of [{args.balance}], {what} (medians of "
              f"{args.rounds}; the wait before {args.before}, busy during {args.busy})")
        print(wide.round(3).to_string())
    balance = args.balance.replace(",", "_")
    model = "" if args.model == "mlp" else f"{args.model}_"  # (MLP's keep their first names)
    name = f"neighbour_idle_{model}{balance}_stage{args.stage}"
    if args.before != "B" or args.busy != "all":
        name += f"_before{args.before}_busy{args.busy}"
    path = write_results(name, table, {**machine(), **vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
