"""Dependencies between actions, and the check that a schedule can run to the end."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.errors import ScheduleError
from pipesim.schedule.action import BACKWARD, FORWARD, Action

if TYPE_CHECKING:
    from pipesim.schedule.action import Schedule


def dependencies(action: Action, n_stages: int) -> list[Action]:
    """Actions whose results ``action`` consumes.

    F(s, m) needs F(s-1, m)'s output; B(s, m) needs F(s, m) (its saved activations) and
    B(s+1, m)'s input gradient.
    """
    s, kind, m = action
    if kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    deps = [Action(s, FORWARD, m)]
    if s < n_stages - 1:
        deps.append(Action(s + 1, BACKWARD, m))
    return deps


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and cannot deadlock.

    Complete: each of F and B for every (stage, micro-batch) appears exactly once, on the
    device its stage is placed on.  Deadlock-free: executing each device's list in order,
    with sends that never block, reaches the end; otherwise the error lists every
    device's stuck action and what it waits for.
    """
    n, m = schedule.n_stages, schedule.n_microbatches
    if len(schedule.placement) != n:
        raise ScheduleError(f"placement has {len(schedule.placement)} entries for {n} stages")
    seen: dict[Action, int] = {}
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
    if len(seen) != 2 * n * m:
        expected = {Action(s, k, mb) for s in range(n) for k in (FORWARD, BACKWARD)
                    for mb in range(m)}
        missing = sorted(expected - set(seen), key=lambda a: (a.microbatch, a.stage, a.kind))
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(f"schedule {schedule.name!r} lacks {len(missing)} action(s): {shown}")
    _check_progress(schedule)


def _check_progress(schedule: Schedule) -> None:
    """Run the lists abstractly; a device advances while its next action's inputs exist.

    Work-list driven: a finished action wakes only the devices its results feed, so the
    check is linear in the number of actions.  ``done`` is indexed by
    ``(stage * m + microbatch) * 2 + is_backward`` for speed.
    """
    n, m, placement, order = (schedule.n_stages, schedule.n_microbatches, schedule.placement,
                              schedule.order)
    done = bytearray(2 * n * m)
    pos = [0] * schedule.n_devices
    wake = list(range(schedule.n_devices))
    while wake:
        d = wake.pop()
        actions = order[d]
        p = pos[d]
        while p < len(actions):
            s, kind, mb = actions[p]
            if kind == FORWARD:
                if s > 0 and not done[((s - 1) * m + mb) * 2]:
                    break
                done[(s * m + mb) * 2] = 1
                if s + 1 < n:
                    wake.append(placement[s + 1])
            else:
                if not done[(s * m + mb) * 2] or (s + 1 < n and not done[((s + 1) * m + mb) * 2 + 1]):
                    break
                done[(s * m + mb) * 2 + 1] = 1
                if s > 0:
                    wake.append(placement[s - 1])
            p += 1
        pos[d] = p
    stuck = []
    for d, actions in enumerate(order):
        if pos[d] < len(actions):
            a = actions[pos[d]]
            waits = [str(x) for x in dependencies(a, n)
                     if not done[(x.stage * m + x.microbatch) * 2 + (x.kind == BACKWARD)]]
            stuck.append(f"device {d} at {a} waits for {', '.join(waits)}")
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: " + "; ".join(stuck))
