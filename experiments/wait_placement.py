"""What a wait costs a stage thread, by what its core does meanwhile.

Two stages of the small gpt (``validate_threads.py``'s, 5 layers each, one torch thread,
no autograd) take turns: each runs its forward while the other waits, as two stage
threads do at one micro-batch.  Each way below runs a block of turns; the blocks of all
ways alternate, and each block's median forward is read against the block of ``hot``
just before it (this VM's pace moves by up to 2x within seconds)::

    hot              one thread  |F0|F1|F0|F1|          no wait at all
    sleep            one thread  |F0|..|F1|..|          sleeps as long as a forward
    threads_free     t0 |F0|....|F0|    t1 ....|F1|....   woken through an event,
    threads_2_cores  (the same, each thread on a core of its own)
    threads_1_core   (the same, both threads on one core)

If the cost is the thread's wait, every way but ``hot`` pays it; if it is its core's
idle, ``threads_1_core`` does not (its core runs the other stage meanwhile).  What
``pipesim``'s idle costs are read at (:class:`pipesim.readings.IdleCost`: the device's
idle where stage threads share one core) rests on this.

    python experiments/wait_placement.py [--blocks 40] [--turns 20]
Writes experiments/results/wait_placement.csv/.json: each way's ratio to ``hot`` per block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch

from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.validate_threads import MODELS

Forward = Callable[[], None]


def _timed(fn: Forward) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_thread(stages: list[Forward], turns: int, sleep_s: float = 0.0) -> list[float]:
    """Each stage's forward in turn in this thread, ``sleep_s`` after each: seconds each."""
    out = []
    for _ in range(turns):
        for fn in stages:
            out.append(_timed(fn))
            if sleep_s:
                time.sleep(sleep_s)
    return out


def two_threads(stages: list[Forward], turns: int,
                cores: tuple[int, int] | None = None) -> list[float]:
    """Each stage's forward on a thread of its own (on ``cores[i]``; None: where the
    operating system puts it), taking turns through events: seconds each."""
    go = [threading.Event() for _ in stages]
    out: list[list[float]] = [[] for _ in stages]

    def serve(i: int) -> None:
        if cores is not None:
            os.sched_setaffinity(0, {cores[i]})
        for _ in range(turns):
            go[i].wait()
            go[i].clear()
            out[i].append(_timed(stages[i]))
            go[(i + 1) % len(stages)].set()

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(stages))]
    for t in threads:
        t.start()
    go[0].set()
    for t in threads:
        t.join()
    return [s for pair in zip(*out, strict=True) for s in pair]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--turns", type=int, default=20, help="turns of both stages a block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    module, _, x, _ = builtin_job("gpt", 32, **MODELS["gpt"])
    layers = list(module)
    first, second = torch.nn.Sequential(*layers[:5]), torch.nn.Sequential(*layers[5:])
    with torch.no_grad():
        hidden = first(x)

    def forward(stage: torch.nn.Module, inputs: torch.Tensor) -> Forward:
        def run() -> None:
            with torch.no_grad():
                stage(inputs)
        return run

    stages = [forward(first, x), forward(second, hidden)]
    cores = sorted(os.sched_getaffinity(0))
    pace = statistics.median(one_thread(stages, args.turns))
    ways: dict[str, Callable[[], list[float]]] = {
        "sleep": lambda: one_thread(stages, args.turns, sleep_s=pace),
        "threads_free": lambda: two_threads(stages, args.turns),
        "threads_1_core": lambda: two_threads(stages, args.turns, (cores[0], cores[0])),
    }
    if len(cores) > 1:
        ways["threads_2_cores"] = lambda: two_threads(stages, args.turns, (cores[0], cores[1]))
    rows = []
    for block in range(args.blocks):
        for way, run in ways.items():
            hot = statistics.median(one_thread(stages, args.turns))
            rows.append({"block": block, "way": way, "hot_ms": 1e3 * hot,
                         "ratio": statistics.median(run()) / hot})
    table = pd.DataFrame(rows)
    summary = table.groupby("way").ratio.describe(percentiles=[0.25, 0.5, 0.75])
    print(f"a forward at its steady pace: {1e3 * pace:.3f} ms; each way against it, "
          "per block:")
    print(summary[["count", "25%", "50%", "75%"]].round(3).to_string())
    write_results("wait_placement", table,
                  {**machine(), "turns": args.turns, "cores": cores, "sleep_s": pace,
                   "median_ratio": summary["50%"].round(4).to_dict(),
                   "torch": torch.__version__})


if __name__ == "__main__":
    main()
