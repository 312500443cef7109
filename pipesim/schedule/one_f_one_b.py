"""1F1B (PipeDream-flush): after a warm-up, each device alternates one forward, one backward.

4 stages, 6 micro-batches (F then B; digits are micro-batches)::

    dev0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
    dev1  .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
    dev2  .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5
    dev3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

Stage ``s`` of ``n`` runs ``min(n - s - 1, m)`` warm-up forwards, then pairs
(forward ``k``, backward ``k - warmup``), then the remaining backwards.  Same iteration
time as GPipe on uniform stages, but stage 0 never holds more than ``n`` micro-batches.
"""

from __future__ import annotations

from pipesim.errors import PlanError
from pipesim.plan import Plan
from pipesim.schedule.action import BACKWARD, FORWARD, Action


def one_f_one_b_order(plan: Plan) -> list[list[Action]]:
    n, m = plan.n_stages, plan.n_microbatches
    if plan.stage_devices != tuple(range(n)):
        raise PlanError(f"1f1b runs one stage per device, but placement is "
                        f"{list(plan.stage_devices)}; use schedule 'interleaved' for several")
    order = []
    for s in range(n):
        warmup = min(n - s - 1, m)
        acts = [Action(s, FORWARD, k) for k in range(warmup)]
        for k in range(warmup, m):
            acts += [Action(s, FORWARD, k), Action(s, BACKWARD, k - warmup)]
        acts += [Action(s, BACKWARD, k) for k in range(m - warmup, m)]
        order.append(acts)
    return order
