"""Peak memory of a run from the CUDA caching allocator's own statistics.

The peak is ``torch.cuda.max_memory_allocated`` over the measured steps (reset at the
start of each), less what the process held before the step that is not the plan's:
memory of earlier models and plans does not pollute it.  CPU has no allocator
statistics: there (and on CUDA for a timeline) :mod:`executor.memtrack` counts tensors.
"""

from __future__ import annotations

import torch

from executor.memory import tensor_bytes
from executor.memtrack import held_tensors

#: what a CUDA peak counts (the measured trace's ``meta["memory_counted"]``)
CUDA_PEAK_COUNTS = ("allocator peak during the measured steps, less what was allocated before "
                    "each step, plus this plan's parameters and gradients allocated before it")


def reset_cuda_peaks(devices: list[torch.device]) -> dict[str, int]:
    """Reset the allocator peaks; returns the bytes allocated now per CUDA device."""
    base = {}
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        base[str(d)] = int(torch.cuda.memory_allocated(d))
    return base


def cuda_peaks(devices: list[torch.device], base: dict[str, int] | None = None,
               own: dict[str, int] | None = None) -> dict[str, int]:
    """Allocator peak per CUDA device of the run itself: ``peak - base + own``.

    ``base`` is what was allocated when the step began (other models and plans of the
    process included), ``own`` what of it is the plan's (parameters, gradients).
    """
    base, own = base or {}, own or {}
    return {str(d): int(torch.cuda.max_memory_allocated(d)) - base.get(str(d), 0) + own.get(str(d), 0)
            for d in {d for d in devices if d.type == "cuda"}}


def plan_bytes(modules: dict[torch.device, list[torch.nn.Module]]) -> dict[str, int]:
    """Bytes of parameters, buffers and existing gradients per device (the plan's own)."""
    return {str(device): tensor_bytes(held_tensors(mods)) for device, mods in modules.items()}
