"""Helpers shared by the experiment scripts: timing medians and result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict:
    import os

    return {"machine": platform.machine(), "processor": platform.processor(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_results(name: str, table: pd.DataFrame, meta: dict, subdir: str = "") -> Path:
    """Write ``results/[subdir/]NAME.csv`` and ``NAME.json`` (context); returns the CSV path."""
    folder = RESULTS / subdir if subdir else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.csv"
    table.to_csv(path, index=False)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str))
    return path


class PhaseClock:
    """Wall seconds each phase of a long run took, printed as each ends and kept
    (``seconds``: phase -> seconds, summed where a phase recurs) for the run's summary: on
    a lent machine with a time limit, the next run is planned from where this one's time
    went::

        clock = PhaseClock()
        calibrate(...)
        clock.mark("calibration")          # prints "[   31 s] calibration: 31 s"
    """

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """End ``phase`` now: its seconds are those since the previous mark (or the start)."""
        now = time.perf_counter()
        took, self.last = now - self.last, now
        self.seconds[phase] = self.seconds.get(phase, 0.0) + took
        print(f"[{now - self.start:6.0f} s] {phase}: {took:.0f} s", flush=True)


def gloo_rank(rank: int, port: int, world: int = 2, timeout_s: float = 120.0) -> None:
    """This process as ``rank`` of a gloo process group of ``world`` on this machine, on one
    torch thread: a micro-benchmark's rank (spawned by ``executor.calibrate._gather``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def hidden_layers(width: int, depth: int):
    """``depth`` hidden layers of the built-in MLP (Linear + ReLU, ``width`` wide), as an
    ``nn.Sequential``: a stage of the CPU grid's MLP for a micro-benchmark."""
    import torch

    from executor.models import mlp

    return torch.nn.Sequential(*list(mlp(width=width, depth=depth + 1,
                                         in_features=width).module)[1:depth + 1])
