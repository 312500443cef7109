"""Dependencies between actions, and the check that a schedule can run to the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.errors import ScheduleError
from pipesim.schedule.action import (
    BACKWARD,
    FORWARD,
    GRADIENT_KINDS,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
)

if TYPE_CHECKING:
    from pipesim.schedule.action import Schedule


def dependencies(action: Action, n_stages: int, split: bool = False) -> list[Action]:
    """Actions whose results ``action`` consumes.

    F(s, m) needs F(s-1, m)'s output.  B(s, m) and I(s, m) need F(s, m) (its saved
    activations) and the input gradient of stage s+1, made by B(s+1, m) -- or by I(s+1, m)
    when ``split`` says stage s+1's backward is split.  W(s, m) needs I(s, m) (the output
    gradients it leaves behind).
    """
    s, kind, m = action
    if kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    if kind == WEIGHT_GRAD:
        return [Action(s, INPUT_GRAD, m)]
    deps = [Action(s, FORWARD, m)]
    if s < n_stages - 1:
        deps.append(Action(s + 1, INPUT_GRAD if split else BACKWARD, m))
    return deps


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and cannot deadlock.

    Complete: every (stage, micro-batch) has one F and either one B or one I and one W,
    each once, on the device its stage is placed on.  Deadlock-free: executing each
    device's list in order, with sends that never block, reaches the end; otherwise the
    error lists every device's stuck action and what it waits for.
    """
    n, m = schedule.n_stages, schedule.n_microbatches
    if len(schedule.placement) != n:
        raise ScheduleError(f"placement has {len(schedule.placement)} entries for {n} stages")
    seen: dict[Action, int] = {}
    bit = {FORWARD: 1, BACKWARD: 2, INPUT_GRAD: 4, WEIGHT_GRAD: 8}
    cells = [0] * (n * m)  # the kinds each (stage, micro-batch) has, as bits
    for device, actions in enumerate(schedule.order):
        for a in actions:
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                raise ScheduleError(f"action {a} is outside {n} stages x {m} micro-batches")
            if a in seen:
                raise ScheduleError(f"action {a} appears twice (devices {seen[a]} and {device})")
            if schedule.placement[a.stage] != device:
                raise ScheduleError(f"action {a} is on device {device} but stage {a.stage} is "
                                    f"placed on device {schedule.placement[a.stage]}")
            seen[a] = device
            cells[a.stage * m + a.microbatch] |= bit[a.kind]
    problems = []
    for cell in (c for c, kinds in enumerate(cells) if kinds not in (1 | 2, 1 | 4 | 8)):
        s, mb = divmod(cell, m)
        f, b, i, w = (bool(cells[cell] & bit[k])
                      for k in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD))
        if not f:
            problems.append(f"{Action(s, FORWARD, mb)} missing")
        if b and (i or w):
            problems.append(f"stage {s} micro-batch {mb} has both B and a split backward")
        elif not (b or i or w):
            problems.append(f"{Action(s, BACKWARD, mb)} (or its I and W) missing")
        elif not b:
            problems += [f"{Action(s, k, mb)} missing"
                         for k, there in ((INPUT_GRAD, i), (WEIGHT_GRAD, w)) if not there]
    if problems:
        shown = ", ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
        raise ScheduleError(f"schedule {schedule.name!r} is incomplete ({len(problems)} "
                            f"problem(s)): {shown}")
    _check_progress(schedule)


def _check_progress(schedule: Schedule) -> None:
    """Run the lists abstractly; a device advances while its next action's inputs exist.

    Work-list driven: a finished action wakes only the devices its results feed, so the
    check is linear in the number of actions.  ``done`` is indexed by
    ``(stage * m + microbatch) * 3 + slot``, slot 0 the forward, 1 the input gradient
    (B or I), 2 the weight gradients (B or W), for speed.
    """
    n, m, placement, order = (schedule.n_stages, schedule.n_microbatches, schedule.placement,
                              schedule.order)
    done = bytearray(3 * n * m)
    pos = [0] * schedule.n_devices
    wake = list(range(schedule.n_devices))
    while wake:
        d = wake.pop()
        actions = order[d]
        p = pos[d]
        while p < len(actions):
            s, kind, mb = actions[p]
            at = (s * m + mb) * 3
            if kind == FORWARD:
                if s > 0 and not done[at - 3 * m]:
                    break
                done[at] = 1
                if s + 1 < n:
                    wake.append(placement[s + 1])
            elif kind == WEIGHT_GRAD:
                if not done[at + 1]:
                    break
                done[at + 2] = 1
            else:
                if not done[at] or (s + 1 < n and not done[at + 3 * m + 1]):
                    break
                done[at + 1] = 1
                if kind == BACKWARD:
                    done[at + 2] = 1
                if s > 0:
                    wake.append(placement[s - 1])
            p += 1
        pos[d] = p
    stuck = []
    for d, actions in enumerate(order):
        if pos[d] < len(actions):
            a = actions[pos[d]]
            waits = [str(x) for x in _waits(a, schedule) if not done[_slot(x, m)]]
            stuck.append(f"device {d} at {a} waits for {', '.join(waits)}")
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))


def _waits(action: Action, schedule: Schedule) -> list[Action]:
    """``dependencies`` with the next stage's gradient named as that stage makes it."""
    s, _, mb = action
    split = s + 1 < schedule.n_stages and any(
        a == Action(s + 1, INPUT_GRAD, mb) for a in schedule.order[schedule.placement[s + 1]])
    return dependencies(action, schedule.n_stages, split)


def _slot(action: Action, m: int) -> int:
    slot = 0 if action.kind == FORWARD else 1 if action.kind in GRADIENT_KINDS else 2
    return (action.stage * m + action.microbatch) * 3 + slot
