"""Balancing: split layers into contiguous stages.

* :func:`even_balance` -- by layer count alone (what users guess).
* :func:`block_partition` -- torchgpipe's ``balance_by_time`` idea: cut the per-layer
  times into contiguous blocks greedily towards equal sums.
* :func:`min_max_partition` -- exact: dynamic programming over cut points minimising the
  slowest stage, where a stage's cost may include sending its output.
* :func:`stage_firsts` -- each stage's first layer, from a balance.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipesim.errors import PlanError


def _check(n_layers: int, n_stages: int) -> None:
    if n_stages < 1:
        raise PlanError(f"need at least one stage, got {n_stages}")
    if n_stages > n_layers:
        raise PlanError(f"{n_stages} stages is more than the {n_layers} layers")


def stage_firsts(balance: Sequence[int]) -> list[int]:
    """Each stage's first layer (its index in the model)::

        stage_firsts([1, 3, 2]) == [0, 1, 4]
    """
    return [sum(balance[:i]) for i in range(len(balance))]


def even_balance(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage as equal as counts allow; earlier stages get the extra layers."""
    _check(n_layers, n_stages)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def block_partition(costs: Sequence[float], n_stages: int) -> list[int]:
    """Greedy contiguous blocks: close a stage once it reaches the average share.

    Like torchgpipe's block partitioning of per-layer times: fast, not optimal.
    """
    c = np.asarray(costs, dtype=float)
    n = len(c)
    _check(n, n_stages)
    balance: list[int] = []
    start = 0
    for s in range(n_stages):
        left = n_stages - s
        if left == 1:
            balance.append(n - start)
            break
        target = c[start:].sum() / left
        stop, acc = start, 0.0
        # take layers while the block stays below the target (or is empty), leaving at
        # least one layer for each remaining stage
        while stop < n - (left - 1) and (stop == start or acc + c[stop] / 2 <= target):
            acc += c[stop]
            stop += 1
        balance.append(stop - start)
        start = stop
    return balance


def min_max_partition(costs: Sequence[float] | np.ndarray, n_stages: int,
                      boundary_costs: Sequence[float] | None = None) -> list[int]:
    """Exact contiguous partition minimising the largest stage cost.

    ``costs[i]``: seconds of layer ``i`` (forward + backward).  ``boundary_costs[i]``:
    seconds added to a stage that ends after layer ``i`` (sending its output and
    receiving the gradient), ignored for the last stage.  O(n_stages * n_layers^2).
    Among partitions with the same slowest stage, the one with the smallest sum of squared
    stage costs wins, which spreads the slack evenly.
    """
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    _check(n, n_stages)
    edge = np.zeros(n) if boundary_costs is None else np.asarray(boundary_costs, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    # best[k][j]: (max stage cost, sum of squares) of the first j layers in k stages
    best = [[(inf, inf)] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            last = k == n_stages
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev[0] == inf:
                    continue
                stage = prefix[j] - prefix[i] + (0.0 if last else edge[j - 1])
                cand = (max(prev[0], stage), prev[1] + stage * stage)
                if cand < best[k][j]:
                    best[k][j] = cand
                    cut[k][j] = i
    balance = []
    j = n
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        balance.append(j - i)
        j = i
    return balance[::-1]
