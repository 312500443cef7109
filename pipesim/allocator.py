"""What a caching allocator reserves for a predicted memory timeline: an estimate.

The simulator predicts *allocated* bytes (what tensors hold).  A GPU runs out of memory on
*reserved* bytes: PyTorch's CUDA caching allocator takes segments from the driver and
keeps them until ``torch.cuda.empty_cache()``, so a process holds at least its peak
allocated, plus what the segments' shapes waste.  This module states those shapes as
assumptions (:class:`CachingAllocator`, PyTorch's documented defaults) and turns a Trace's
per-device timeline into reserved bytes::

    reserved  = rounded(static) + rounded((dynamic peak + streams x workspace) x (1 + f))
    allocated = peak + streams x workspace      (what max_memory_allocated shows)

    static      parameters and optimizer state (the memory category "parameters"):
                allocated once, before the pipeline runs, in segments of their own
    dynamic     everything else at its peak (activations, gradients, received buffers,
                temporaries), carved from segments that are cut and reused as blocks
    workspace   what the CUDA libraries allocate once per stream that runs matmuls
                (cuBLAS: on an H100 with CUDA 13, 3 x 32 MiB + 3 x 1 MiB)
    f           fragmentation: free blocks too small or on the wrong stream for the next
                request (the H100 snapshots of the 2026-11-23 grid: 0-10% of the stream's
                allocated peak)
    rounded     up to the 2 MiB a large segment is rounded to

The workspaces are tensors of the allocator too: the first matmul a stream runs takes
them and they stay for the process's life, so a fresh process's ``max_memory_allocated``
holds them beside the pipeline's own peak (:meth:`CachingAllocator.allocated`,
:func:`allocated_peaks`), while a peak measured from a baseline taken after earlier work
(as ``gpu_validate.py`` frees memory between plans) does not.

It is an estimate for budgets, not a replay of the allocator: the simulator knows a
layer's saved bytes, not the tensors that make them up, so rounding per request (512
bytes; small requests in 2 MiB segments, up to 10 MiB in 20 MiB ones) is folded into
``f``.  Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipesim.trace import Trace, metrics

MiB = 2**20


@dataclass(frozen=True)
class CachingAllocator:
    """Assumptions about a caching allocator (bytes); defaults: PyTorch's CUDA allocator.

    ``segment_bytes`` says which segment a request of a given size opens, the allocator's
    documented rule; ``reserved`` applies the module's estimate.
    """

    #: every request is rounded up to a multiple of this
    round_bytes: int = 512
    #: requests up to ``small_request`` come from ``small_segment`` segments ...
    small_request: int = 1 * MiB
    small_segment: int = 2 * MiB
    #: ... up to ``medium_request`` from ``medium_segment`` ones; larger ones open a
    #: segment of their own, rounded up to ``large_round``
    medium_request: int = 10 * MiB
    medium_segment: int = 20 * MiB
    large_round: int = 2 * MiB
    #: bytes the math libraries allocate per stream that runs matmuls (0: not counted)
    workspace_bytes: int = 0
    #: share of the dynamic peak that free but unusable blocks add to reserved
    fragmentation: float = 0.10

    def __post_init__(self) -> None:
        if self.fragmentation < 0 or self.workspace_bytes < 0:
            raise ValueError(f"fragmentation and workspace_bytes must be >= 0, got "
                             f"{self.fragmentation}, {self.workspace_bytes}")

    def segment_bytes(self, request: float) -> int:
        """Bytes of the segment a request of ``request`` bytes opens when no cached block
        fits it."""
        size = _round_up(request, self.round_bytes)
        if size <= self.small_request:
            return self.small_segment
        if size < self.medium_request:
            return self.medium_segment
        return _round_up(size, self.large_round)

    def allocated(self, peak_bytes: float, streams: int = 1) -> float:
        """Peak allocated bytes of a fresh process whose tensors peak at ``peak_bytes`` on
        the device, run by ``streams`` streams: its workspaces included."""
        return peak_bytes + streams * self.workspace_bytes

    def reserved(self, static_bytes: float, dynamic_peak_bytes: float, streams: int = 1) -> int:
        """Reserved bytes of a device whose parameters and optimizer state take
        ``static_bytes`` and whose other tensors peak at ``dynamic_peak_bytes``, run by
        ``streams`` streams (see the module doc)."""
        dynamic = (dynamic_peak_bytes + streams * self.workspace_bytes) * (1 + self.fragmentation)
        static = _round_up(static_bytes, self.large_round) if static_bytes > 0 else 0
        return static + (_round_up(dynamic, self.large_round) if dynamic > 0 else 0)


#: the CUDA allocator with the cuBLAS workspaces an H100 with CUDA 13 allocates per
#: stream (3 x 32 MiB + 3 x 1 MiB: the 2026-11-22 recordings' peaks exceed today's by
#: exactly two streams' worth, and the profiler's leaked streams each hold 99 MiB)
CUDA_H100 = CachingAllocator(workspace_bytes=99 * MiB)


def reserved_peaks(trace: Trace, allocator: CachingAllocator = CUDA_H100,
                   streams: dict[str, int] | None = None) -> dict[str, int]:
    """Estimated reserved bytes per device of a simulated Trace (its memory per category).

    ``streams[device]``: streams that run the device's work (default: the workers placed
    on it, one stream each, as pipesim's executor runs them).
    """
    by_category = trace.memory_by_category
    if by_category is None or by_category.empty:
        raise ValueError("the trace has no memory per category: simulate with track_memory")
    streams = _streams(trace) if streams is None else streams
    static: dict[str, float] = {}
    dynamic: dict[str, float] = {}
    # (the last level of each category at each instant: changes at one instant are one step)
    levels = by_category.pivot_table(index=["iteration", "device", "time"], columns="category",
                                     values="bytes", aggfunc="last")
    for (_, device), part in levels.groupby(level=["iteration", "device"]):
        # each category's level holds until its next change: carry it forward in time
        filled = part.sort_index().ffill().fillna(0.0)
        name = str(device)
        if "parameters" in filled:
            static[name] = max(static.get(name, 0.0), float(filled["parameters"].max()))
        rest = filled.drop(columns=["parameters"], errors="ignore").sum(axis=1)
        dynamic[name] = max(dynamic.get(name, 0.0), float(rest.max()))
    return {d: allocator.reserved(static.get(d, 0.0), dynamic[d], streams.get(d, 1))
            for d in dynamic}


def allocated_peaks(trace: Trace, allocator: CachingAllocator = CUDA_H100,
                    streams: dict[str, int] | None = None) -> dict[str, float]:
    """Peak allocated bytes per device of a simulated Trace as a fresh process's
    ``torch.cuda.max_memory_allocated`` shows them: the trace's peak and each stream's
    workspaces (``streams`` as for :func:`reserved_peaks`)."""
    streams = _streams(trace) if streams is None else streams
    peaks = metrics(trace).peak_memory_bytes
    return {d: allocator.allocated(peak, streams.get(d, 1)) for d, peak in peaks.items()}


def _streams(trace: Trace) -> dict[str, int]:
    """Streams per device: the workers placed on it, one stream each."""
    counts: dict[str, int] = {}
    for device in trace.meta.get("devices", {}).values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    return counts


def _round_up(n: float, to: int) -> int:
    # (a level summed from float deltas may sit a hair above a whole number of units)
    return math.ceil(n / to - 1e-9) * to


__all__ = ["CUDA_H100", "CachingAllocator", "MiB", "allocated_peaks", "reserved_peaks"]
