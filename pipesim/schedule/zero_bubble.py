"""Zero-bubble schedules (Qi et al., 2024): the backward split into I and W, W deferred.

Only the input gradient ``I`` is on the critical path back to stage 0; the weight
gradient ``W`` can run whenever its device would otherwise idle.  Both schedules here are
built the way the paper's heuristic builds them: a list scheduler plays the pipeline
with unit-time F, I and W, and each device, when free, takes

    1. an I whose gradient has arrived (it unblocks the previous stage),
    2. else the next F whose input has arrived, unless its stages already hold ``cap``
       micro-batches' activations (an F holds them until its W),
    3. else its oldest pending W,
    4. else it waits for the next action to end anywhere.

The order it produces is the schedule; whatever the real durations, it is then checked
like any other (complete, deadlock-free).  Stage 0's input is data: its I is instant and
its W the whole backward (as the executor runs them, :mod:`executor.split_backward`).

ZB-H1 (``zb-h1``): one stage a device, cap ``n - s`` on stage ``s`` -- 1F1B's peak
activation memory.  Steady state is F I W; the cool-down's gaps fill with W.  4 stages,
6 micro-batches, unit times (digits: micro-batches; 1F1B takes 27 units here)::

    dev0  F0 F1 F2 F3  .  .  . W0 W0 F4 W1 W1 F5 W2 W2  . W3 W3  . W4 W4  . W5 W5
    dev1   . F0 F1 F2  .  . I0 W0 F3 I1 W1 F4 I2 W2 F5 I3 W3  . I4 W4  . I5 W5  .
    dev2   .  . F0 F1  . I0 W0 F2 I1 W1 F3 I2 W2 F4 I3 W3 F5 I4 W4  . I5 W5  .  .
    dev3   .  .  . F0 I0 W0 F1 I1 W1 F2 I2 W2 F3 I3 W3 F4 I4 W4 F5 I5 W5  .  .  .

(stage 0's I is instant, its W two units).

ZB-H2 (``zb-h2``): the same with cap ``2n - 1 - s``: about twice 1F1B's activations on
stage 0, and no bubble left when F, I and W take equal time (21 units above).

ZB-V (``zbv``): two stages a device in a V -- device ``d`` of ``n`` holds stages ``d``
and ``2n - 1 - d`` -- so the first and the last stage (the loss) share device 0 and a
micro-batch's backward starts where its forward ended.  Cap ``2n`` half-size stages a
device: 1F1B's activation memory, with a bubble that all but vanishes when F, I and W
take equal time.  2 devices, 4 micro-batches, half-size stages (``sKm``: stage s, kind K,
micro-batch m; 13 units where ideal is 12; stage 0's instant I not drawn)::

    dev0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0W0 0W0 0W1 0W1 3F2 3I2 3W2   . ...
    dev1    . 1F0 2F0 1F1 2F1 2I0 1I0 2W0 2I1 1I1 1F2 1W0 2F2 2W1 1F3 1W1 2I2 1I2 ...
"""

from __future__ import annotations

import heapq

from pipesim.errors import PlanError, ScheduleError
from pipesim.plan import Plan, v_placement
from pipesim.schedule.action import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action

#: relative durations the list scheduler assumes (F, I, W): equal, as for matmul layers
UNIT_TIMES = (1.0, 1.0, 1.0)


def zero_bubble_order(n_stages: int, n_microbatches: int, placement: tuple[int, ...],
                      cap: list[int], times: tuple[float, float, float] = UNIT_TIMES
                      ) -> list[list[Action]]:
    """Per-device action lists of the greedy zero-bubble scheduler (module docstring).

    ``cap[d]`` bounds the micro-batch activations device ``d``'s stages hold at once (F
    done, W not yet).  Raises :class:`ScheduleError` when a cap is too small to finish.
    """
    n, m = n_stages, n_microbatches
    n_devices = max(placement) + 1
    t_f, t_i, t_w = times
    stages_of = [[s for s in range(n) if placement[s] == d] for d in range(n_devices)]
    fwd_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> end time
    grad_end: dict[tuple[int, int], float] = {}  # I ends: the gradient to stage s-1
    next_f = [0] * n  # next micro-batch of each stage to forward / to input-grad
    next_i = [0] * n
    pending_w: list[list[Action]] = [[] for _ in range(n_devices)]
    held = [0] * n_devices
    order: list[list[Action]] = [[] for _ in range(n_devices)]
    free_at = [0.0] * n_devices
    total = 3 * n * m
    issued = 0
    ends: list[float] = []  # a min-heap of action end times, when idle devices look again

    def ready_i(s: int, now: float) -> float | None:
        mb = next_i[s]
        if mb >= m or (s, mb) not in fwd_end:
            return None
        ready = fwd_end[(s, mb)] if s == n - 1 else grad_end.get((s + 1, mb))
        return ready if ready is not None and ready <= now else None

    def ready_f(s: int, now: float) -> float | None:
        mb = next_f[s]
        if mb >= m:
            return None
        ready = 0.0 if s == 0 else fwd_end.get((s - 1, mb))
        return ready if ready is not None and ready <= now else None

    waiting: set[int] = set()  # devices that found nothing to do at their free_at
    while issued < total:
        d = min(range(n_devices), key=lambda k: (free_at[k], k in waiting, k))
        now = free_at[d]
        if d in waiting:  # every device free now waits: move them to the next action end
            while ends and ends[0] <= now:
                heapq.heappop(ends)
            if not ends:
                raise ScheduleError(f"zero-bubble scheduling stuck at time {now}: a memory cap "
                                    f"of {[cap[k] for k in sorted(waiting)]} micro-batches on "
                                    f"device(s) {sorted(waiting)} is too small")
            for k in waiting:
                free_at[k] = max(free_at[k], ends[0])
            waiting.clear()
            continue
        choice: Action | None = None
        # 1. an input gradient: the earliest ready, the later stage on a tie
        inputs = [(r, -s) for s in stages_of[d] if (r := ready_i(s, now)) is not None]
        if inputs:
            s = -min(inputs)[1]
            choice = Action(s, INPUT_GRAD, next_i[s])
        elif held[d] < cap[d]:
            # 2. a forward: the later stage first (it brings a micro-batch to its loss)
            forwards = [s for s in stages_of[d] if ready_f(s, now) is not None]
            if forwards:
                s = max(forwards)
                choice = Action(s, FORWARD, next_f[s])
        if choice is None and pending_w[d]:
            choice = pending_w[d].pop(0)  # 3. the oldest deferred weight gradient
        if choice is None:  # 4. wait for the next action to end anywhere
            waiting.add(d)
            continue
        s, kind, mb = choice
        if kind == FORWARD:
            end = now + t_f
            fwd_end[(s, mb)] = end
            next_f[s] += 1
            held[d] += 1
        elif kind == INPUT_GRAD:
            end = now + (t_i if s > 0 else 0.0)  # stage 0's input is data: no gradient
            grad_end[(s, mb)] = end
            next_i[s] += 1
            pending_w[d].append(Action(s, WEIGHT_GRAD, mb))
        else:
            end = now + t_w + (t_i if s == 0 else 0.0)  # stage 0's W is its whole backward
            held[d] -= 1
        order[d].append(choice)
        free_at[d] = end
        heapq.heappush(ends, end)
        issued += 1
    return order


def _one_stage_a_device(plan: Plan, name: str, extra: int) -> list[list[Action]]:
    """The order for one stage a device with cap ``n - s + extra`` on stage ``s``."""
    n = plan.n_stages
    if plan.stage_devices != tuple(range(n)):
        raise PlanError(f"{name} runs one stage per device, but placement is "
                        f"{list(plan.stage_devices)}; use 'zbv' for two stages a device")
    return zero_bubble_order(n, plan.n_microbatches, plan.stage_devices,
                             [n - s + extra for s in range(n)])


def zb_h1_order(plan: Plan) -> list[list[Action]]:
    """ZB-H1: one stage a device, 1F1B's memory, W deferred into the gaps."""
    return _one_stage_a_device(plan, "zb-h1", 0)


def zb_h2_order(plan: Plan) -> list[list[Action]]:
    """ZB-H2: ZB-H1 with ``n - 1`` more micro-batches in flight a stage: no bubble."""
    return _one_stage_a_device(plan, "zb-h2", plan.n_stages - 1)


def zbv_order(plan: Plan) -> list[list[Action]]:
    """ZB-V: two stages a device in a V (:func:`v_placement`), 1F1B's memory."""
    n = plan.n_devices
    if plan.n_stages != 2 * n or plan.stage_devices != v_placement(n):
        raise PlanError(f"zbv needs 2 stages a device in a V, placement {list(v_placement(n))} "
                        f"(virtual_stages=2), got {list(plan.stage_devices)}")
    return zero_bubble_order(plan.n_stages, plan.n_microbatches, plan.stage_devices,
                             [2 * n] * n)
