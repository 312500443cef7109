"""What a stage's forward pays after other memory, a sleep or a spin: this VM's caches.

In the 2-process CPU grids MLP [4,4]'s 1F1B forwards ran 0.59-0.72 ms where GPipe's ran
0.31-0.42 (the same stage, 2 samples), and a lone stage's forward after its own backward
took 0.31 ms (``experiments/idle_kinds.py``).  Between two forwards of a 1F1B stage come
its own backward and the other rank's forward and backward (some 28 MiB of weights,
gradients and activations); between two of GPipe's, the other rank's forward (4 MiB).
Is it that traffic, evicting the stage's weights from the last-level cache the ranks
share (32 MiB on this VM, with other tenants), or the time between them?  One MLP stage
(the grid's, its first four layers: 4 MiB of weights; plain torch calls on core 0),
GPipe's order, before each forward (untimed) one of:

* ``hot``: nothing;
* ``touch X``: core 0 reads and writes X MiB of other memory;
* ``sleep W`` / ``spin W``: core 0 asleep, or spinning in Python, W ms;
* ``sleep W + core 1 X``: asleep W ms while a process pinned to core 1 reads and writes
  X MiB (another rank's traffic, which leaves core 0's private caches alone).

It prints the median forward per condition and size.  What it found (2026-11-30, 3
rounds; ms at 2 samples): see ``experiments/README.md`` (session 47): the time asleep or
spinning costs as much as streaming the whole cache, and another core's traffic adds
little on top of a wait -- on this VM what an action's working set loses is mostly a
matter of time (the idle costs, measured in place, charge it), not of what the other
rank touches.

    python experiments/cache_decay.py [--rounds 3] [--sizes 2,8]
Writes experiments/results/cache_decay.csv (one row per round, size and condition) and
cache_decay.json (the medians).
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
import torch

from executor.models import builtin_job
from executor.partition import split_module
from experiments.common import machine, write_results
from experiments.validate import BATCH, MODELS

#: forwards a round of each condition runs (the grid's largest chunk count)
MICROBATCHES = 16
TOUCH_MIB = (4, 8, 16, 32, 48)
WAIT_MS = (1, 5)
OTHER_MIB = (16, 48)


def _other_core(go, done, mib: int) -> None:
    """Core 1's side: stream ``mib`` MiB each time ``go`` is set, then set ``done``."""
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    buffer = torch.zeros(mib * 2**20 // 4)
    while True:
        go.wait()
        go.clear()
        buffer.add_(1.0)
        done.set()


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(rounds: int, sizes: list[int]) -> pd.DataFrame:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    module, _loss, x, _y = builtin_job("mlp", BATCH * 4, **MODELS["mlp"])
    stage = split_module(module, [4, 4])[0]
    touch = {mib: torch.zeros(mib * 2**20 // 4) for mib in TOUCH_MIB}
    ctx = mp.get_context("spawn")
    others = {}
    for mib in OTHER_MIB:
        go, done = ctx.Event(), ctx.Event()
        ctx.Process(target=_other_core, args=(go, done, mib), daemon=True).start()
        others[mib] = (go, done)

    def before(case: tuple) -> None:
        what, amount, extra = case
        if what == "touch":
            touch[amount].add_(1.0)
        elif what == "sleep":
            time.sleep(amount / 1e3)
        elif what == "spin":
            _spin(amount / 1e3)
        elif what == "sleep+other":
            go, done = others[extra]
            done.clear()
            go.set()
            time.sleep(amount / 1e3)
            done.wait()

    cases = [("hot", 0, 0), *(("touch", m, 0) for m in TOUCH_MIB),
             *(("sleep", w, 0) for w in WAIT_MS), *(("spin", w, 0) for w in WAIT_MS),
             *(("sleep+other", 5, m) for m in OTHER_MIB)]
    rows = []
    for r in range(rounds):
        for size in sizes:
            inputs = [x[i * size:(i + 1) * size] for i in range(MICROBATCHES)]
            for case in cases:
                outputs, forwards = [], []
                for i in range(MICROBATCHES):
                    before(case)
                    t0 = time.perf_counter()
                    outputs.append(stage(inputs[i]))
                    forwards.append(time.perf_counter() - t0)
                for out in reversed(outputs):
                    out.backward(torch.ones_like(out))
                what, amount, extra = case
                name = {"hot": "hot", "touch": f"touch {amount} MiB",
                        "sleep": f"sleep {amount} ms", "spin": f"spin {amount} ms",
                        "sleep+other": f"sleep {amount} ms + core 1 {extra} MiB"}[what]
                rows.append({"round": r, "size": size, "case": name,
                             "forward_ms": statistics.median(forwards[2:]) * 1e3})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="2,8")
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        ap.error("needs two cores (core 1 streams beside core 0)")
    sizes = [int(s) for s in args.sizes.split(",")]
    table = measure(args.rounds, sizes)
    medians = table.groupby(["case", "size"], sort=False).forward_ms.median().unstack("size")
    print("MLP [4,4] stage 0 forward (ms) after each condition, by micro-batch size:")
    print(medians.round(3).to_string())
    write_results("cache_decay", table, {
        "machine": machine(), "rounds": args.rounds, "microbatches": MICROBATCHES,
        "median_forward_ms": {str(s): medians[s].round(4).to_dict() for s in sizes}})


if __name__ == "__main__":
    main()
