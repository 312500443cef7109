"""Recording measured action times: a host clock on CPU, CUDA events on GPU.

Every worker records ``(stage, microbatch, kind)`` intervals.  Times are seconds from the
iteration's origin: a host ``perf_counter`` read at the origin (CPU), or an event recorded
on each device right after a synchronisation at the origin (CUDA).  ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process on a machine; processes on
different machines align their origins at a barrier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Recorder:
    """Intervals measured by one worker on one device."""

    worker: int
    device: torch.device
    origin: float = 0.0  # host seconds (perf_counter) of the iteration's origin
    origin_event: torch.cuda.Event | None = None
    _open: dict = field(default_factory=dict)
    _rows: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self, stage: int, mb: int, kind: str) -> None:
        key = (stage, mb, kind)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[key] = ev
        else:
            self._open[key] = time.perf_counter()

    def stop(self, stage: int, mb: int, kind: str, nbytes: int = 0, resource: str = "") -> None:
        key = (stage, mb, kind)
        begin = self._open.pop(key)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._rows.append((stage, mb, kind, begin, end, nbytes, resource or f"dev{self.worker}"))

    def rows(self, iteration: int) -> list[tuple]:
        """Resolved rows ``(iteration, device, stage, mb, kind, start, end, nbytes, resource)``.

        On CUDA this synchronises the device first.
        """
        out = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for stage, mb, kind, begin, end, nbytes, resource in self._rows:
            if self.cuda:
                s = self.origin_event.elapsed_time(begin) / 1e3
                e = self.origin_event.elapsed_time(end) / 1e3
            else:
                s, e = begin - self.origin, end - self.origin
            out.append((iteration, self.worker, stage, mb, kind, s, e, nbytes, resource))
        self._rows.clear()
        return out
