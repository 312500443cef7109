"""Memory as torch allocates it: every storage an op creates, on CPU as on CUDA.

A :class:`Tracker` is a dispatch mode (``TorchDispatchMode``): it sees every operator
that runs in the threads that entered it -- forward, backward (autograd runs CPU work in
the calling thread and carries the mode to its own threads) and recomputation -- and
counts each *new* storage an op returns (an output that shares an input's storage is a
view or an in-place result: nothing new), until Python frees it (a weak reference's
callback).  So it sees what a hand-made ledger cannot: temporaries inside a layer, the
gradients being formed, recomputed activations.

    timeline = Timeline()
    timeline.add_existing("dev0", model.parameters())   # present before the run
    with Tracker(timeline, "dev0"):
        loss = model(x).sum(); loss.backward()
    timeline.peak["dev0"], timeline.rows                  # bytes; (seconds, device, bytes)

Sizes are storage bytes, rounded up to ``granularity`` (512 on CUDA, the caching
allocator's block; 1 on CPU).  What it does not see: the caching allocator's reserved
but unused blocks (CUDA reports those, see ``torch.cuda.memory_reserved``), and memory
that kernels take outside torch tensors (cuBLAS workspaces, oneDNN scratch).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _round(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity if n else 0


class Timeline:
    """Bytes alive per device over time, shared by the trackers of one run (thread-safe).

    ``rows`` holds ``(perf_counter seconds, device, bytes after the change)`` in order;
    ``peak`` the highest level per device.
    """

    def __init__(self, granularity: int = 1):
        self.granularity = granularity
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, int, weakref.ref]] = {}  # storage id -> device, bytes
        self.level: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.rows: list[tuple[float, str, int]] = []

    def _change(self, device: str, delta: int) -> None:
        self.level[device] += delta
        if self.level[device] > self.peak[device]:
            self.peak[device] = self.level[device]
        self.rows.append((time.perf_counter(), device, self.level[device]))

    def add(self, device: str, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` on ``device`` until it is freed (once, however often added)."""
        key = storage._cdata
        with self._lock:
            if key in self._live:
                return
            n = _round(storage.nbytes(), self.granularity)
            ref = weakref.ref(storage, functools.partial(self._dropped, key))
            self._live[key] = (device, n, ref)
            self._change(device, n)

    def _dropped(self, key: int, _ref: weakref.ref) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._change(entry[0], -entry[1])

    def add_existing(self, device: str, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist before the tracked work (parameters, gradients)."""
        for t in tensors:
            self.add(device, t.untyped_storage())

    def forget(self) -> None:
        """Stop counting: later frees change nothing (call before dropping the timeline)."""
        with self._lock:
            self._live.clear()


class Tracker(TorchDispatchMode):
    """Adds to ``timeline`` (under ``device``) every new storage an op returns; see module."""

    def __init__(self, timeline: Timeline, device: str):
        super().__init__()
        self.timeline, self.device = timeline, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs:
            inputs = {t.untyped_storage()._cdata
                      for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in outputs:
                storage = t.untyped_storage()
                if storage._cdata not in inputs and t.device.type != "meta":
                    self.timeline.add(self.device, storage)
        return out


def held_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """What modules hold before a step: parameters, buffers and existing gradients."""
    out: list[torch.Tensor] = []
    for m in modules:
        out += [*m.parameters(), *m.buffers()]
        out += [p.grad for p in m.parameters() if p.grad is not None]
    return out


def warm_up(device: torch.device) -> None:
    """Pay a dispatch mode's one-time set-up (up to a second in a fresh process) outside
    the tracked work, so that a tracked timeline is not stretched at its start."""
    timeline = Timeline()
    with Tracker(timeline, "warm-up"):
        x = torch.ones(2, 2, device=device, requires_grad=True)
        (x * x).sum().backward()
    timeline.forget()


def granularity_of(device: torch.device) -> int:
    """Allocation rounding on ``device``: 512 bytes on CUDA, exact on CPU."""
    return 512 if device.type == "cuda" else 1
