"""Contention: how actions that run at the same time on one resource slow each other.

The simulator's engine (:mod:`pipesim.simulator`) decides *when* an action may start; this
module decides *how fast* it then progresses while others share its resource.  Two
resources are shared this way:

* a **host** (CPU processes of one machine: memory bandwidth, caches, communication
  threads), law :func:`host_law`;
* a **device whose streams run kernels concurrently** (several pipeline workers on one
  GPU), law :func:`device_law`;
* the **interpreter** of a process whose threads are workers: the share of an action
  that holds it runs one thread at a time, :func:`interpreter_law` (the action ends when
  both its work and that share are done).  A pass whose Python is cut into many short
  sections (torch.utils.checkpoint's hooks) loses more than its turn: each section waits
  for the lock anew, so it runs ``slowdown`` times slower still while contended
  (:meth:`ProcessorSharing.run`).

Both are *processor sharing*: while ``k`` actions run on the resource, each progresses at
``rate(k)`` seconds of work per second (``rate(1) == 1``).  An action of ``w`` seconds of
work that shares the resource half of its life with another one lasts longer than ``w``
but less than the two run back to back whenever ``k * rate(k) > 1``::

    alone:      A |==========|                    B |==========|
    sharing:    A |=====-----------|              k * rate(k) = 1.2 for k = 2:
                B      |-----------=====|         the pair ends 0.8x as late as in turn

The interface to the engine is one call, :meth:`ProcessorSharing.run` (an event that
fires when the work is done), so a new law needs no change in the engine.

Threads of one process may instead share by **pairs** measured pass beside pass
(:class:`PairSharing`): the interpreter, autograd's device thread and the device all at
once, each direction its own figure, since a pass that holds the interpreter in long
stretches starves one that needs it in many short ones (not a processor-sharing law:
the rate of an action depends on what runs beside it, not on how many do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import simpy

#: rate(k): seconds of work done per second by each of ``k`` actions running together
RateLaw = Callable[[int], float]


def host_law(contention: float, cores: int = 0) -> RateLaw:
    """Each of ``k`` actions on one host runs at ``1 / (1 + contention * (j - 1))`` times
    ``j / k``, where ``j = min(k, cores)`` actions hold a core at a time.

    ``contention`` is what one more busy neighbour costs (0.05: 5% slower), measured by
    ``executor.calibrate`` with processes computing alone and together, no more of them
    than there are cores.  ``cores`` (0: as many as there are actions) is how many actions
    the host runs at once -- its cores over the threads each action uses: beyond that the
    operating system time-slices them, and each gets its share of the cores.
    """
    def rate(k: int) -> float:
        j = min(k, cores) if cores else k
        return (j / k) / (1.0 + contention * (j - 1))

    return rate


def device_law(speedup: Sequence[float]) -> RateLaw:
    """Kernels of ``k`` streams on one device: together they run ``speedup[k-1]`` times as
    fast as one stream alone (``speedup[0] == 1``), so each at ``speedup[k-1] / k``.

    ``speedup`` beyond its length repeats its last value (a saturated device).  A device
    that one stream saturates has speedup 1 (the streams take turns, in effect); one that
    a single stream leaves mostly idle (small kernels, launch-bound layers) approaches k.
    """
    table = [1.0, *(float(s) for s in speedup[1:])]
    if any(not 1.0 <= s <= k + 1 for k, s in enumerate(table)):
        raise ValueError(f"device speedup must lie in [1, k] for k streams, got {list(speedup)}")

    def rate(k: int) -> float:
        return table[min(k, len(table)) - 1] / k

    return rate


def interpreter_law(k: int) -> float:
    """Threads of one Python process holding its interpreter: one at a time, so each of
    ``k`` progresses at ``1 / k``."""
    return 1.0 / k


def speedup_from_scaling(time_at: Callable[[float], float], size: float, streams: int) -> list[float]:
    """Concurrency law of a device measured by its own size scaling (see :func:`device_law`).

    ``k`` streams each running micro-batches of ``size`` samples keep the device as busy
    as one stream running ``k * size``: the device's idle share at ``size`` is what a second
    stream can fill.  So ``speedup[k-1] = k * time_at(size) / time_at(k * size)``, clamped
    to [1, k] (``time_at``: seconds of the work at a micro-batch size).  This reads the
    law off a profile; a direct measurement (two streams at once against one) replaces it
    where one is available.
    """
    base = time_at(size)
    out = [1.0]
    for k in range(2, streams + 1):
        together = time_at(k * size)
        s = k * base / together if together > 0 else 1.0
        out.append(float(min(max(s, 1.0), float(k))))
    return out


class ProcessorSharing:
    """A resource shared by the actions running on it, each at ``law(k)`` (see module doc).

    Each running action has work left (seconds at full speed); all progress at the law's
    rate (an action with a ``slowdown`` at that rate over its slowdown while it has
    company), which changes whenever an action starts or ends, so one timer -- to the
    next completion -- is kept and rebuilt on every change.

    An action may carry a ``priority``: only the actions of the highest priority present
    are served (sharing by the law among themselves); the others wait, their work left
    untouched, and resume as those end -- a preemptive priority queue, which is what
    autograd's device thread is (see :mod:`pipesim.simulator`)::

        priority 0   A |====..........====|      A waits while B is served
        priority 1   B      |==========|
    """

    def __init__(self, env: simpy.Environment, law: RateLaw):
        self.env, self.law = env, law
        self.work: dict[simpy.Event, float] = {}
        self.slowdown: dict[simpy.Event, float] = {}
        self.priority: dict[simpy.Event, float] = {}
        self.paused = 0  # while above 0 nothing progresses (see pause)
        self.last = 0.0
        self.timer = 0  # generation of the pending timer: older ones are ignored

    def _rates(self) -> dict[simpy.Event, float]:
        """Each running action's rate: the law's, over its slowdown, while shared; 0
        while an action of a higher priority runs."""
        k = len(self.work)
        if self.paused:
            return dict.fromkeys(self.work, 0.0)
        if k <= 1:
            return dict.fromkeys(self.work, 1.0)
        top = max(self.priority.values())
        served = [ev for ev in self.work if self.priority[ev] == top]
        if len(served) == 1:
            return {ev: 1.0 if ev is served[0] else 0.0 for ev in self.work}
        shared = self.law(len(served))
        return {ev: shared / self.slowdown[ev] if self.priority[ev] == top else 0.0
                for ev in self.work}

    def _advance(self) -> None:
        now = self.env.now
        elapsed = now - self.last
        for ev, rate in self._rates().items():
            self.work[ev] -= elapsed * rate
        self.last = now

    def _schedule(self) -> None:
        self.timer += 1
        if not self.work:
            return
        generation = self.timer
        delays = [max(self.work[ev], 0.0) / rate for ev, rate in self._rates().items() if rate > 0]
        if not delays:  # (paused: nothing ends until it resumes)
            return
        self.env.timeout(min(delays)).callbacks.append(lambda _e: self._expire(generation))

    def _expire(self, generation: int) -> None:
        if generation != self.timer:
            return
        self._advance()
        for ev in [e for e, w in self.work.items() if w <= 1e-12]:
            del self.work[ev], self.slowdown[ev], self.priority[ev]
            ev.succeed()
        self._schedule()

    def run(self, seconds: float, slowdown: float = 1.0, priority: float = 0.0) -> simpy.Event:
        """An event that fires when ``seconds`` of work is done at the shared rate, over
        ``slowdown`` (>= 1) whenever the resource is shared, served only while no action
        of a higher ``priority`` is running."""
        self._advance()
        ev = self.env.event()
        self.work[ev], self.slowdown[ev], self.priority[ev] = seconds, slowdown, priority
        self._schedule()
        return ev

    def pause(self) -> None:
        """Nothing runs on the resource until :meth:`resume` (as often as paused): the one
        thread it stands for runs something else meanwhile, which the caller times (a
        recomputation on autograd's thread, :mod:`pipesim.simulator`).  Each action's work
        left is kept."""
        self._advance()
        self.paused += 1
        self._schedule()

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        if not self.paused:
            raise RuntimeError("resume without a pause")
        self._advance()
        self.paused -= 1
        self._schedule()


class PairSharing(ProcessorSharing):
    """Threads of one process, each action slowed by what runs beside it: an action of
    pass X with others of passes Y1, Y2, ... running progresses at
    ``1 / (1 + sum((max(ratio[X|Yi], 1) - 1))``), its ``ratio`` row the measured pair
    slowdowns of its pass at its size (``pipesim.profile.Profile.pair_slowdown``, in the
    order of ``pipesim.profile.PAIR_KINDS``).  Exact for two threads, as measured; a
    third adds its own slowdown (an assumption: no measurement of three).
    """

    def __init__(self, env: simpy.Environment, kinds: Sequence[str]):
        super().__init__(env, interpreter_law)
        self.index = {k: i for i, k in enumerate(kinds)}
        self.kind: dict[simpy.Event, str] = {}
        self.row: dict[simpy.Event, Sequence[float]] = {}

    def _rates(self) -> dict[simpy.Event, float]:
        rates = {}
        for ev in self.work:
            row = self.row[ev]
            slowdown = 1.0 + sum(max(row[self.index[self.kind[other]]], 1.0) - 1.0
                                 for other in self.work if other is not ev)
            rates[ev] = 1.0 / slowdown
        return rates

    def _expire(self, generation: int) -> None:
        super()._expire(generation)
        for ev in [ev for ev in self.kind if ev not in self.work]:  # those that ended
            del self.kind[ev], self.row[ev]

    def run_pass(self, seconds: float, kind: str, row: Sequence[float]) -> simpy.Event:
        """An event that fires when ``seconds`` of pass ``kind``'s work is done, slowed
        by the ``row`` of its ratios beside each pass while others run."""
        if kind not in self.index or len(row) != len(self.index):
            raise ValueError(f"pass {kind!r} with {len(row)} ratios; passes are "
                             f"{list(self.index)}, a ratio beside each")
        self._advance()
        ev = self.env.event()
        self.work[ev], self.slowdown[ev], self.priority[ev] = seconds, 1.0, 0.0
        self.kind[ev], self.row[ev] = kind, row
        self._schedule()
        return ev


__all__ = ["PairSharing", "ProcessorSharing", "RateLaw", "device_law", "host_law",
           "interpreter_law", "speedup_from_scaling"]
