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

import bisect
import functools
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: a storage counted: (device, bytes, counted at, freed at or None, label)
Storage = tuple[str, int, float, float | None, str]


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
        # storage id -> device, bytes, its reference, when it was counted
        self._live: dict[int, tuple[str, int, weakref.ref, float]] = {}
        self.level: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.rows: list[tuple[float, str, int]] = []
        #: storages that went: (storage id, device, bytes, counted at, freed at)
        self.lives: list[tuple[int, str, int, float, float]] = []
        #: what made each storage, where the tracker names it (``Tracker(..., label=True)``):
        #: (storage id, counted at) -> the operator and its first output's shape
        self.labels: dict[tuple[int, float], str] = {}

    def _change(self, device: str, delta: int) -> float:
        self.level[device] += delta
        if self.level[device] > self.peak[device]:
            self.peak[device] = self.level[device]
        now = time.perf_counter()
        self.rows.append((now, device, self.level[device]))
        return now

    def add(self, device: str, storage: torch.UntypedStorage, label: str = "") -> None:
        """Count ``storage`` on ``device`` until it is freed (once, however often added);
        ``label``: what made it, kept in :attr:`labels`."""
        key = storage._cdata
        with self._lock:
            if key in self._live:
                return
            n = _round(storage.nbytes(), self.granularity)
            ref = weakref.ref(storage, functools.partial(self._dropped, key))
            born = self._change(device, n)
            self._live[key] = (device, n, ref, born)
            if label:
                self.labels[(key, born)] = label

    def _counted(self) -> list[tuple[int, str, int, float, float | None]]:
        """Every storage counted, gone or alive: ``(id, device, bytes, counted at, freed
        at or None)``."""
        with self._lock:
            return self.lives + [(k, d, n, born, None)
                                 for k, (d, n, _, born) in self._live.items()]

    def storages(self) -> list[Storage]:
        """Every storage counted: ``(device, bytes, counted at, freed at or None, label)``,
        in the order they were counted (call before :meth:`forget`)."""
        return sorted(((d, n, born, freed, self.labels.get((k, born), ""))
                       for k, d, n, born, freed in self._counted()), key=lambda r: r[2])

    def _dropped(self, key: int, _ref: weakref.ref) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                device, n, _, born = entry
                self.lives.append((key, device, n, born, self._change(device, -n)))

    def add_existing(self, device: str, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist before the tracked work (parameters, gradients)."""
        for t in tensors:
            self.add(device, t.untyped_storage())

    def by_category(self, classify) -> list[tuple[float, str, str, int]]:
        """Levels ``(seconds, device, category, bytes)`` after each change, where
        ``classify(storage id, device, counted at, freed at or None)`` names each storage's
        category (call before :meth:`forget`, while the live storages are known)."""
        events = []
        for key, device, n, born, freed in self._counted():
            category = classify(key, device, born, freed)
            events.append((born, 1, device, category, n))
            if freed is not None:
                events.append((freed, 0, device, category, -n))  # frees first at one instant
        events.sort(key=lambda e: (e[0], e[1]))
        level: dict[tuple[str, str], int] = defaultdict(int)
        out = []
        for t, _, device, category, delta in events:
            level[(device, category)] += delta
            out.append((t, device, category, level[(device, category)]))
        return out

    def forget(self) -> None:
        """Stop counting: later frees change nothing (call before dropping the timeline)."""
        with self._lock:
            self._live.clear()


class Tracker(TorchDispatchMode):
    """Adds to ``timeline`` (under ``device``) every new storage an op returns; see module.
    With ``label``, each is labelled with the operator that made it (a diagnosis: what is
    alive at a peak, :meth:`Timeline.storages`)."""

    def __init__(self, timeline: Timeline, device: str, label: bool = False):
        super().__init__()
        self.timeline, self.device, self.label = timeline, device, label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs:
            inputs = {t.untyped_storage()._cdata
                      for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in outputs:
                storage = t.untyped_storage()
                if storage._cdata not in inputs and t.device.type != "meta":
                    self.timeline.add(self.device, storage,
                                      f"{func} {tuple(t.shape)}" if self.label else "")
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


#: what a tracked storage holds, as pipesim's simulator sorts it (pipesim.simulator)
MEASURED_CATEGORIES = ("parameters", "gradients", "activations", "temporaries")


def classifier(modules: Iterable[torch.nn.Module], actions: dict[str, list[tuple[float, float]]]):
    """A ``classify`` for :meth:`Timeline.by_category`, after a step of ``modules``:
    parameters and buffers; the weight gradients they hold now; temporaries, born and gone
    inside one action of their device (``actions[device]``: (start, end) seconds, the
    timeline's clock); and activations, everything else (saved for backward, received,
    sent: tensors that outlive the action that made them)."""
    params: set[int] = set()
    grads: set[int] = set()
    for m in modules:
        params |= {t.untyped_storage()._cdata for t in [*m.parameters(), *m.buffers()]}
        grads |= {p.grad.untyped_storage()._cdata for p in m.parameters() if p.grad is not None}
    spans = {device: sorted(s) for device, s in actions.items()}
    starts = {device: [a for a, _ in s] for device, s in spans.items()}

    def classify(key: int, device: str, born: float, freed: float | None) -> str:
        # (parameters and gradients are alive at the end; a storage freed earlier whose id
        # they reuse -- an id is an address -- is something else)
        if freed is None and key in params:
            return "parameters"
        if freed is None and key in grads:
            return "gradients"
        i = bisect.bisect_right(starts.get(device, []), born) - 1  # the action it was born in
        if freed is not None and i >= 0 and freed <= spans[device][i][1]:
            return "temporaries"
        return "activations"

    return classify


def granularity_of(device: torch.device) -> int:
    """Allocation rounding on ``device``: 512 bytes on CUDA, exact on CPU."""
    return 512 if device.type == "cuda" else 1
