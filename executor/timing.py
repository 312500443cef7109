"""Clocks for timing torch work: host clock on CPU, CUDA events on GPU.

Both return seconds.  ``Stopwatch`` is used by the profiler and the pipeline runtime so
that predictions and measurements are taken with the same clock.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Times regions on one device; ``elapsed()`` returns the seconds of each region.

    On CUDA the regions are bracketed by events and read after one synchronisation, so
    timing does not serialise the host with the device inside the measured loop.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cpu: list[float] = []  # host seconds of every region (on CPU: the time)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def region(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            yield
            self._cpu.append(time.perf_counter() - t0)
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu.append(time.perf_counter() - t0)

    def host_elapsed(self) -> list[float]:
        """Host seconds of every region: how long the Python call took to issue the work
        (no synchronisation inside).  On CPU the same as :meth:`elapsed`."""
        return list(self._cpu)

    def elapsed(self) -> list[float]:
        """Seconds of every region so far, in order."""
        if self.device.type == "cuda":
            synchronize(self.device)
            return [s.elapsed_time(e) / 1e3 for s, e in self._events]
        return list(self._cpu)


def speed_reference(module: torch.nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    """Seconds of ``module``'s forward on ``x``, the median of ``repeats`` after one
    warm-up: a fixed piece of work whose time follows the machine's speed of the moment.

    Run without gradients and in evaluation mode, so that it changes nothing: no random
    numbers drawn (dropout is off), no running statistics updated, no gradient touched;
    the module's mode is restored.  A shared machine's speed drifts by 10-20% over
    minutes: read beside each plan of a grid (``executor.distributed.spawn_plans(...,
    reference=True)``), it says how fast the machine ran that plan against the others.
    """
    training = module.training
    module.eval()
    watch = Stopwatch(x.device)  # the clock the profiler and the pipelines time with
    try:
        with torch.no_grad():
            module(x)
            for _ in range(repeats):
                with watch.region():
                    module(x)
    finally:
        module.train(training)
    return statistics.median(watch.elapsed())
