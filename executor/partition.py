"""Cutting an ``nn.Sequential`` into stages (modules are shared, not copied)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def split_module(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Stages of ``balance[i]`` consecutive layers each; raises ValueError on a mismatch."""
    if sum(balance) != len(module):
        raise ValueError(f"balance {list(balance)} sums to {sum(balance)} layers but the module "
                         f"has {len(module)}")
    layers = list(module)
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return stages


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in train mode (dropout of any kind)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())
