"""Peak memory per device: CUDA allocator statistics, or a byte ledger on CPU.

On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the measured iteration (reset
at its start), the allocator's truth.  CPU has no allocator statistics, so there the
runtime keeps a ledger of what it holds: parameters, gradients and optimizer state
(``plan.optimizer_state_factor`` bytes per parameter byte), plus per micro-batch in
flight the storages autograd saved in the forward (counted once, parameters excluded),
the received input and the stage output, released when the backward ends.  The ledger
measures real tensors, not the allocator's fragmentation or temporaries.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class MemoryLedger:
    """Thread-safe byte ledger per device name, with peaks."""

    def __init__(self):
        self._lock = threading.Lock()
        self.level: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)

    def add(self, device: str, nbytes: int) -> None:
        with self._lock:
            self.level[device] += nbytes
            self.peak[device] = max(self.peak[device], self.level[device])


def reset_cuda_peaks(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)


def cuda_peaks(devices: list[torch.device]) -> dict[str, int]:
    return {str(d): int(torch.cuda.max_memory_allocated(d))
            for d in {d for d in devices if d.type == "cuda"}}
