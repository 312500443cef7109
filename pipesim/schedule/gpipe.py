"""GPipe: all forwards in torchgpipe's clock-cycle order, then all backwards in reverse.

4 stages, 4 micro-batches, one stage per device (digits are micro-batches; F then B)::

    dev0  F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B3 B2 B1 B0
    dev1  .  F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
    dev2  .  .  F0 F1 F2 F3 .  .  .  B3 B2 B1 B0
    dev3  .  .  .  F0 F1 F2 F3 B3 B2 B1 B0

In clock cycle ``k`` torchgpipe runs the tasks ``(m, s)`` with ``m + s == k``; a device
holding several stages runs its forwards in that order too.  Every micro-batch's
activations stay stashed until the backward phase: stage 0 holds all ``m`` at its peak.
"""

from __future__ import annotations

from pipesim.plan import Plan
from pipesim.schedule.action import BACKWARD, FORWARD, Action


def gpipe_order(plan: Plan) -> list[list[Action]]:
    m, placement = plan.n_microbatches, plan.stage_devices
    order: list[list[Action]] = [[] for _ in range(plan.n_devices)]
    for d in range(plan.n_devices):
        stages = [s for s in range(plan.n_stages) if placement[s] == d]
        cells = sorted(((mb, s) for s in stages for mb in range(m)), key=lambda c: (sum(c), c[1]))
        order[d] = [Action(s, FORWARD, mb) for mb, s in cells]
        order[d] += [Action(s, BACKWARD, mb) for mb, s in reversed(cells)]
    return order
