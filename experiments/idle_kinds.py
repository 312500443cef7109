"""Does a wait before a backward cost the forward after it?  A lone stage, actions in turn.

The idle costs measured in place (:func:`executor.in_place.idle_costs`) time an action
right after its rank slept.  In a 1F1B pipeline a rank's forward comes right after a
backward that itself waited for its gradient::

    1F1B   |F1|send|..wait..|B0|gap|F2|      F2 starts 0.1-0.2 ms after B0: "no idle"
    GPipe  |F1|send|F2|send|F3|              each F right after the one before

yet in the 2-process CPU grids the 1F1B [4,4] MLP plans' forwards ran at 0.59-0.72 ms
where GPipe's ran at 0.31-0.36 (the same stage, the same 2 samples).  This times one
stage alone (the grid's MLP, its first four layers, pinned to one core, no messages,
plain torch calls), its actions in the orders below, in turn within each round so the
machine's drift weighs on all alike:

* ``F after F``: sixteen forwards, then sixteen backwards (GPipe's order);
* ``F after B``: 1F1B's order, nothing slept;
* ``F after B after W``: 1F1B's order, the rank asleep ``W`` seconds before each backward
  (a 1F1B rank waiting for its gradient): what the forward after that backward costs;
* ``F after W``: 1F1B's order, asleep ``W`` before each forward (what the in-place idle
  costs measure).

It reads each forward's median (the first two of each order left out) and writes them.
What it found (2026-11-29, 5 rounds, 2 samples): 0.24 ms after a forward, 0.31 after a
backward, 0.31 / 0.37 / 0.43 after a backward that followed 0.3 / 1 / 3 ms asleep, and
0.37 / 0.46 / 0.50 right after those sleeps.  The model of it is measured in place, not
taken from here: :func:`executor.in_place.idle_costs`' kind ``"FB"`` (a stage's forward
right after a backward that waited), which the simulator charges a forward that follows a
backward on its worker (:class:`pipesim.readings.IdleCost`).

    python experiments/idle_kinds.py [--rounds 5] [--sizes 2,8] [--waits 0.0003,0.001,0.003]
Writes experiments/results/idle_kinds.csv (one row per round, size and order) and
idle_kinds.json (the medians over the rounds).
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

from executor.models import builtin_job
from executor.partition import split_module
from experiments.common import machine, write_results
from experiments.validate import BATCH, MODELS

#: micro-batches a round of each order runs (a grid's largest chunk count)
MICROBATCHES = 16


def orders(m: int) -> dict[str, list[tuple[str, int]]]:
    """The action orders timed, by name: GPipe's and 1F1B's for one stage of two."""
    gpipe = [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    one_f_one_b = ([("F", 0), ("F", 1)]
                   + [a for i in range(m - 2) for a in (("B", i), ("F", i + 2))]
                   + [("B", m - 2), ("B", m - 1)])
    return {"gpipe": gpipe, "1f1b": one_f_one_b}


def forward_seconds(stage: torch.nn.Module, inputs: list[torch.Tensor],
                    order: list[tuple[str, int]], sleep_before: str = "", wait_s: float = 0.0
                    ) -> float:
    """The median seconds of the forwards of one run of ``order`` (the first two left
    out: the run's own start), asleep ``wait_s`` before each action of kind
    ``sleep_before`` (``""``: never)."""
    outputs: dict[int, torch.Tensor] = {}
    forwards = []
    for kind, i in order:
        if kind == sleep_before and wait_s > 0:
            time.sleep(wait_s)
        t0 = time.perf_counter()
        if kind == "F":
            outputs[i] = stage(inputs[i])
            forwards.append(time.perf_counter() - t0)
        else:
            out = outputs.pop(i)
            out.backward(torch.ones_like(out))
    return statistics.median(forwards[2:])


def measure(rounds: int, sizes: list[int], waits: list[float]) -> pd.DataFrame:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    module, _loss, x, _y = builtin_job("mlp", BATCH * 4, **MODELS["mlp"])
    stage = split_module(module, [4, 4])[0]
    runs = orders(MICROBATCHES)
    cases: list[tuple[str, str, str, float]] = [("F after F", "gpipe", "", 0.0),
                                                ("F after B", "1f1b", "", 0.0)]
    for w in waits:
        cases += [(f"F after B after {w * 1e3:g} ms", "1f1b", "B", w),
                  (f"F after {w * 1e3:g} ms", "1f1b", "F", w)]
    rows = []
    for r in range(rounds):
        for size in sizes:
            inputs = [x[i * size:(i + 1) * size] for i in range(MICROBATCHES)]
            forward_seconds(stage, inputs, runs["1f1b"])  # warm-up
            for name, order, before, w in cases:
                s = forward_seconds(stage, inputs, runs[order], before, w)
                rows.append({"round": r, "size": size, "case": name, "wait_ms": w * 1e3,
                             "forward_ms": s * 1e3})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="2,8")
    ap.add_argument("--waits", default="0.0003,0.001,0.003")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    waits = [float(w) for w in args.waits.split(",")]
    table = measure(args.rounds, sizes, waits)
    medians = table.groupby(["size", "case"], sort=False).forward_ms.median().unstack("size")
    print(medians.round(3).to_string())
    write_results("idle_kinds", table, {
        "machine": machine(), "rounds": args.rounds, "microbatches": MICROBATCHES,
        "median_forward_ms": {str(size): medians[size].round(4).to_dict() for size in sizes}})


if __name__ == "__main__":
    main()
