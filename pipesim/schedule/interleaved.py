"""Interleaved 1F1B (Megatron-LM): ``v`` model chunks per device, looped placement.

Device ``d`` of ``n`` holds stages ``d, d + n, ..., d + (v - 1) n``.  Work proceeds in
groups of ``n`` micro-batches per chunk; 2 devices, v = 2 (stages 0..3), 4 micro-batches,
forward part (``s:m`` = stage s, micro-batch m)::

    dev0  0:0 0:1 2:0 2:1 0:2 0:3 2:2 2:3 ...
    dev1      1:0 1:1 3:0 3:1 1:2 1:3 3:2 ...

Warm-up on device ``d`` is ``2 (n - d - 1) + (v - 1) n`` forwards, then 1F1B pairs, then
the remaining backwards (chunks in reverse).  Each stage is ``1/v`` of a device's work, so
the bubble shrinks by ``v``: idle/busy = ``(n - 1) / (v m)`` on uniform stages.
Needs ``m`` to be a multiple of ``n``.
"""

from __future__ import annotations

from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.schedule.action import BACKWARD, FORWARD, Action


def interleaved_order(plan: Plan) -> list[list[Action]]:
    n, m = plan.n_devices, plan.n_microbatches
    v = plan.n_stages // n
    looped = tuple(s % n for s in range(plan.n_stages))
    if plan.stage_devices != looped or plan.n_stages != n * v:
        raise PlanError(f"interleaved needs the looped placement {list(looped)} "
                        f"(stage s on device s % {n}), got {list(plan.stage_devices)}")
    if m % n:
        raise PlanError(f"interleaved needs micro-batches ({m}) to be a multiple of the "
                        f"{n} devices")
    total = m * v

    def cell(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // n) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (n * v)) * n + k % n

    order = []
    for d in range(n):
        warmup = min(2 * (n - d - 1) + (v - 1) * n, total)
        acts = []
        for k in range(total + warmup):
            if k < total:
                chunk, mb = cell(k, backward=False)
                acts.append(Action(chunk * n + d, FORWARD, mb))
            if k >= warmup:
                chunk, mb = cell(k - warmup, backward=True)
                acts.append(Action(chunk * n + d, BACKWARD, mb))
        order.append(acts)
    return order
