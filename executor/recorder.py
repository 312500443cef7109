"""Recording measured action times: a host clock on CPU, CUDA events on GPU.

Every worker records ``(stage, microbatch, kind)`` intervals.  Times are seconds from the
iteration's origin: a host ``perf_counter`` read at the origin (CPU), or an event recorded
on each device right after a synchronisation at the origin (CUDA).  ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process on a machine; processes on
different machines align their origins at a barrier.

On CUDA each action also keeps its **host interval**: when the worker's Python started
and finished issuing it (``perf_counter``, no synchronisation), beside the device
interval of its events.  A device interval that starts long after its host interval is
a device that was busy; one that ends right after it is a device that waited for the
host (launch-bound).  On CPU the two coincide and the host columns are left empty.
Every action runs inside ``torch.profiler.record_function("PP:1F0")`` as in
torch.distributed.pipelining, so a torch profiler (Kineto) trace of a pipesim run names
the same actions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipesim.trace import COMPUTE_KINDS


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
        label = torch.profiler.record_function(f"PP:{stage}{kind}{mb}")
        label.__enter__()
        host = time.perf_counter()
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[key] = (ev, host, label)
        else:
            self._open[key] = (host, host, label)

    def stop(self, stage: int, mb: int, kind: str, nbytes: int = 0, resource: str = "") -> None:
        key = (stage, mb, kind)
        begin, host_begin, label = self._open.pop(key)
        end: torch.cuda.Event | float
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        host_end = time.perf_counter()
        if not self.cuda:
            end = host_end
        label.__exit__(None, None, None)
        self._rows.append((stage, mb, kind, begin, end, nbytes, resource or f"dev{self.worker}",
                           host_begin, host_end))

    def rows(self, iteration: int) -> list[tuple]:
        """Resolved rows ``(iteration, device, stage, mb, kind, start, end, nbytes, resource,
        host_start, host_end)`` (host columns NaN on CPU; see the module docstring).

        On CUDA this synchronises the device first.
        """
        out = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        nan = float("nan")
        for stage, mb, kind, begin, end, nbytes, resource, h0, h1 in self._rows:
            if self.cuda:
                assert self.origin_event is not None, "record an origin event first"
                s = self.origin_event.elapsed_time(begin) / 1e3
                e = self.origin_event.elapsed_time(end) / 1e3
                hs, he = h0 - self.origin, h1 - self.origin
            else:
                s, e = begin - self.origin, end - self.origin
                hs = he = nan
            out.append((iteration, self.worker, stage, mb, kind, s, e, nbytes, resource, hs, he))
        self._rows.clear()
        return out


def shift_rows(rows: list[tuple], offset: float) -> list[tuple]:
    """Rows with every time (device and host intervals) moved by ``offset`` seconds;
    rows without host columns (transfers) get empty ones, so all fit
    :data:`pipesim.trace.MEASURED_COLUMNS`."""
    nan = float("nan")
    out = []
    for r in rows:
        hs, he = (r[9], r[10]) if len(r) > 9 else (nan, nan)
        out.append((*r[:5], r[5] + offset, r[6] + offset, *r[7:9], hs + offset, he + offset))
    return out


def compute_actions(rows: list[tuple]) -> dict[int, list[tuple[int, int, str, float, float]]]:
    """Each worker's compute actions (F, B, I, W; not the recomputation inside a backward)
    in ``rows`` as ``(stage, micro-batch, kind, start, end)``, times as the rows have them."""
    actions: dict[int, list[tuple[int, int, str, float, float]]] = {}
    for row in rows:
        if row[4] in COMPUTE_KINDS:
            actions.setdefault(row[1], []).append((row[2], row[3], row[4], row[5], row[6]))
    return actions


def compute_spans(rows: list[tuple], origin: float) -> dict[int, list[tuple[float, float]]]:
    """:func:`compute_actions` as ``(start, end)`` on the clock whose zero the rows count
    from: ``origin``."""
    return {w: [(origin + a[3], origin + a[4]) for a in acts]
            for w, acts in compute_actions(rows).items()}
