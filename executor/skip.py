"""Skip connections across stages: a layer stashes a tensor, a later layer pops it.

Declared on the layers themselves, so a model stays a plain ``nn.Sequential``::

    nn.Sequential(
        Down(3, 16), Stash("d1"),          # keeps its input under the name "d1"
        Down(16, 32),
        Up(32, 16), Pop("d1", "cat"),      # concatenates "d1" to its input (dim 1)
        Head(16, 2))

Any module may take part: give it ``stashes``/``pops`` name tuples and call
:func:`stash` / :func:`pop` in its ``forward``.  :func:`check_skips` walks the model once
and reports every stash without a pop, pop without a stash and name clash together.

At run time a :class:`SkipTracker` per (stage, micro-batch) holds the tensors.  Outside
a pipeline a thread-local default tracker makes the model an ordinary module.  Inside one,
the stage runner sends a stashed tensor straight from the stash's stage to the pop's
stage (never through the stages between) and its gradient straight back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


class SkipError(ValueError):
    """The model's stashes and pops do not match (all problems listed)."""


@dataclass
class SkipTracker:
    """Tensors of one micro-batch's skips, by name.

    The thread-local default tracker (plain calls of the model) forgets a tensor once it
    is popped.  A pipeline's tracker (``retain=True``) keeps them, remembers what was
    stashed so the runner can send it on, and once ``closed`` after the first forward it
    stashes nothing new: a recomputation pops the very tensors the first forward popped.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stashed: dict[str, torch.Tensor] = field(default_factory=dict)
    retain: bool = False
    closed: bool = False

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        if self.closed:
            return
        self.tensors[name] = tensor
        if self.retain:
            self.stashed[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise SkipError(f"pop of {name!r} before its stash in this forward")
        return self.tensors[name] if self.retain else self.tensors.pop(name)


_local = threading.local()


def current() -> SkipTracker:
    """The tracker of this thread: the pipeline's, or a default one for plain calls."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


def stash(name: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer of the same forward."""
    current().stash(name, tensor)


def pop(name: str) -> torch.Tensor:
    """The tensor stashed under ``name`` earlier in this forward."""
    return current().pop(name)


class Stash(nn.Module):
    """Passes its input on unchanged and stashes it under ``name``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.stashes = (name,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash(self.name, x)
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


class Pop(nn.Module):
    """Pops ``name`` and merges it with its input: ``"cat"`` (dim 1) or ``"add"``."""

    def __init__(self, name: str, merge: str = "add"):
        super().__init__()
        if merge not in ("add", "cat"):
            raise ValueError(f"merge must be 'add' or 'cat', got {merge!r}")
        self.name, self.merge = name, merge
        self.pops = (name,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = pop(self.name)
        return x + skip if self.merge == "add" else torch.cat([x, skip], dim=1)

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.merge!r}"


def _declared(layer: nn.Module, attribute: str) -> tuple[str, ...]:
    names: list[str] = []
    for m in layer.modules():
        names.extend(getattr(m, attribute, ()))
    return tuple(names)


@dataclass(frozen=True)
class SkipRoute:
    """Skip ``name`` is stashed by layer ``src`` and popped by layer ``dst``."""

    name: str
    src: int
    dst: int


def check_skips(module: nn.Sequential) -> list[SkipRoute]:
    """Every skip of ``module`` as a route; raises :class:`SkipError` listing all problems."""
    open_: dict[str, int] = {}
    routes: list[SkipRoute] = []
    problems: list[str] = []
    seen: set[str] = set()
    for i, layer in enumerate(module):
        for name in _declared(layer, "pops"):
            if name in open_:
                routes.append(SkipRoute(name, open_.pop(name), i))
            else:
                problems.append(f"layer {i} pops {name!r} that no earlier layer stashes")
        for name in _declared(layer, "stashes"):
            if name in open_ or name in seen:
                problems.append(f"layer {i} stashes {name!r}, a name already used")
            open_[name] = i
            seen.add(name)
    for name, i in open_.items():
        problems.append(f"layer {i} stashes {name!r} that no later layer pops")
    if problems:
        raise SkipError("skip connections do not match: " + "; ".join(problems))
    return routes


class _Arrival(torch.autograd.Function):
    """Puts a received skip tensor into the graph without keeping it alive.

    A leaf requiring grad would be held by autograd until the backward, merge or not.
    Here nothing is saved: the gradient that reaches the tensor is captured into ``box``
    and the tensor lives only as long as its consumers need it.  ``phony`` (an empty
    tensor requiring grad) makes autograd record the node at all.
    """

    @staticmethod
    def forward(ctx, phony: torch.Tensor, tensor: torch.Tensor, box: list) -> torch.Tensor:
        del phony
        ctx.box = box
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.box.append(grad)
        return None, None, None


def arrive(tensor: torch.Tensor, box: list) -> torch.Tensor:
    """``tensor`` as a graph input whose gradient will be appended to ``box``."""
    phony = torch.empty(0, device=tensor.device, requires_grad=True)
    return _Arrival.apply(phony, tensor, box)
