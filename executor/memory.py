"""Byte accounting of tensors: what a forward saves for backward, each storage once."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_sizes(value: object) -> dict[tuple[str, int], int]:
    """Storage key -> bytes of every tensor in ``value`` (each storage once)."""
    return {_storage_key(t): t.untyped_storage().nbytes() for t in _tensors(value)}


def tensor_bytes(value: object) -> int:
    """Bytes of a tensor or of the tensors in a (nested) tuple/list, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for t in _tensors(value):
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _tensors(value: object) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return tensor_bytes(list(module.parameters()) + list(module.buffers()))


@dataclass
class SavedTensors:
    """Storages that autograd saved during a forward, keyed by (device, data pointer)."""

    storages: dict[tuple[str, int], int] = field(default_factory=dict)

    def bytes_excluding(self, excluded: set[tuple[str, int]]) -> int:
        return sum(n for k, n in self.storages.items() if k not in excluded)

    def bytes_of(self, value: object) -> int:
        """Bytes of ``value``'s storages that were saved."""
        keys = {_storage_key(t) for t in _tensors(value)}
        return sum(n for k, n in self.storages.items() if k in keys)


@contextmanager
def record_saved_tensors():
    """Record every tensor autograd saves for backward inside the block.

    Yields a :class:`SavedTensors`.  Tensors are kept as they are (the hooks return them
    unchanged); only their storages' sizes are noted, each storage once.
    """
    saved = SavedTensors()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.storages[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def parameter_keys(module: nn.Module) -> set[tuple[str, int]]:
    """Storage keys of a module's parameters and buffers (not activations)."""
    return {_storage_key(t) for t in list(module.parameters()) + list(module.buffers())}
