"""The SimPy model of a pipeline: a Schedule run on a Cluster with Profile costs.

Each worker is a SimPy process that walks its action list in order.  An action starts
when (a) the worker reached it, (b) its inputs arrived, and (c) its physical device's
compute is free (workers sharing a device serially queue on one resource; workers whose
streams run concurrently start at once and share the device's speed instead).  A finished F(s, m)
sends its output to stage s+1, a finished B(s, m) its input gradient to stage s-1, over
the link between the two workers: each direction of a link streams one transfer's bytes
at a time (a copy stream / an async send), so transfers overlap compute but not each
other; latency delays arrival without occupying the link.

Time of an action: profile seconds at the micro-batch's real size, plus the cluster's
per-action overhead; a checkpointed backward also re-runs the forward.  An action starts
the cluster's ``action_gap_s`` after its worker and its input are both ready.  Optional jitter
multiplies each duration by a seeded log-normal factor (and a straggler's factor).
While actions overlap on a concurrently shared device, or on a host whose processes slow
each other, their work progresses at the rate :mod:`pipesim.contention` gives: this
engine decides when an action runs, that module how fast.  Workers that are threads of
one process also hold its interpreter for their measured share of each action, one at a
time; an action then ends when both its work and that share are done.

Memory per physical device (bytes; see :class:`pipesim.costs.StageCost`):

    static      parameters + optimizer state, from time 0
    gradients   + parameter bytes at the first backward of each stage, layer by layer
    stash       + keep_bytes at the end of F(s, m), - during B(s, m): freed layer by
                layer as the backward walks back (with the recomputed activations
                when checkpointed; StageCost.backward_walk)
    recomputed  + during a checkpointed B(s, m)'s recomputation, layer by layer as
                its re-run forward goes (StageCost.recompute_walk), then freed with
                the stash as the backward walks back
    received    + input bytes when an activation arrives from another device (or
                from when its receive is posted, Cluster.receives_ahead), + output
                bytes when a gradient arrives; freed at the end of B(s, m); skips and
                their gradients alike (see Simulator._with_skips)
    transient   during F: its temporaries (profiled ``fwd_transient_bytes``); during B:
                the input gradient being produced, the loss gradient on the last stage,
                and the backward's own temporaries and weight gradients being formed
                (``bwd_transient_bytes``)
    sent        with Cluster.sender_keeps_sends, what a worker sends to another device
                lives on to the step's end (one storage held once)

Each iteration's backward::

    B(s, m) on a stage of layers a..c, checkpointed:
      |--- recompute a, b, c ---|--- backward c ---|-- b --|---- a ----|
      +a      +b      +c         +grads c   -c      +grads b  -b  +grads a  -a
      (+grads only on the stage's first backward; -x: what layer x saved)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
import simpy

from pipesim.cluster import FREE, Cluster
from pipesim.contention import ProcessorSharing, device_law, host_law, interpreter_law
from pipesim.costs import PlanCosts, StageCost
from pipesim.errors import ScheduleError
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Schedule,
    build_schedule,
)
from pipesim.trace import (
    ACTION_COLUMNS,
    CATEGORY_COLUMNS,
    MEMORY_COLUMNS,
    Trace,
    frame_from_rows,
)

#: (stage, kind, microbatch) -> seconds; replaces the whole duration of that action
#: (profile time and the cluster's per-action overhead): replaying a measured run.
Durations = dict[tuple[int, str, int], float]


@dataclass
class Jitter:
    """What-if noise: each duration x lognormal(0, sigma) x stragglers.get(worker, 1)."""

    sigma: float = 0.0
    stragglers: dict[int, float] = field(default_factory=dict)
    seed: int = 0


class _Step(NamedTuple):
    """One action compiled for the SimPy loop (all lookups done once per simulation)."""

    stage: int
    kind: str
    waits: tuple[int, ...]  # events it needs: ``base + 2 * mb`` for each base
    seconds: float  # total duration before jitter (overhead and recomputation included)
    recompute_s: float
    alloc_start: Parts  # bytes allocated when it starts, per category
    alloc_end: Parts  # bytes allocated (negative: freed) when it ends, per category
    send: _Send | None
    extra_sends: tuple[_Send, ...] = ()  # skip tensors or gradients it sends
    release: float = 0.0  # bytes freed progressively while it runs (see walk)
    grads: float = 0.0  # weight-gradient bytes allocated progressively (a first backward)
    walk: tuple[tuple[float, float, float, float], ...] = ((0.0, 1.0, 1.0, 1.0),)  # see StageCost
    recv_bytes: float = 0.0  # its input (gradient) from another device: the receive buffer
    interpreter_s: float = 0.0  # of ``seconds``, those its thread holds the interpreter
    recompute_bytes: float = 0.0  # activations it recomputes, appearing along recompute_walk
    recompute_walk: tuple[tuple[float, float], ...] = ((0.0, 1.0),)  # see StageCost


#: what memory is for (the categories of Trace.memory_by_category): parameters and optimizer
#: state, weight gradients, activations kept for backward (and recomputed ones), buffers
#: received from another device, and temporaries (transients, gradients in flight)
MEMORY_CATEGORIES = ("parameters", "gradients", "activations", "received", "temporaries")
#: their codes, as memory changes carry them (an index into MEMORY_CATEGORIES)
PARAMETERS, GRADIENTS, ACTIVATIONS, RECEIVED, TEMPORARIES = range(len(MEMORY_CATEGORIES))
Parts = tuple[tuple[int, float], ...]


def _parts(*pairs: tuple[int, float]) -> Parts:
    """``(category code, bytes)`` pairs summed per category, zeros dropped."""
    out: dict[int, float] = {}
    for category, nbytes in pairs:
        out[category] = out.get(category, 0.0) + nbytes
    return tuple((c, v) for c, v in out.items() if v)


#: a backward in one part (no per-layer walk known): gradients at its start, frees at its end
_WHOLE = ((0.0, 1.0, 1.0, 1.0),)


class _Send(NamedTuple):
    kind: str  # SEND_F or SEND_B
    event: int  # the receiver's event is ``event + 2 * mb``
    link: tuple[int, int] | None  # (src, dst) worker pair, None for a hand-over
    seconds: float  # link occupancy: overhead + bytes / bandwidth
    latency_s: float
    nbytes: float  # exact (interpolated) bytes: what is allocated is what is freed
    src_device: str
    dst_device: str  # "" when the hand-over needs no new memory
    resource: str  # the link's name in the trace, "dev0->dev1"
    #: the sender keeps what it sent to the step's end (Cluster.sender_keeps_sends); False
    #: for a skip that is the stage's output, kept already as the output sent on
    held: bool = True


class _Run:
    """One simulated iteration; times are offset by ``origin`` seconds.

    ``slots[i]`` tells whether stage input/gradient ``i`` has arrived: ``None`` (nothing
    yet), a float (its arrival time, set by the sender), or a SimPy event the receiver
    waits on (it got there first).  Most arrivals thus cost no SimPy event at all.
    Memory changes are logged as deltas and accumulated after the run.
    """

    def __init__(self, sim: Simulator, iteration: int, origin: float,
                 rng: np.random.Generator | None):
        self.sim, self.iteration, self.origin, self.rng = sim, iteration, origin, rng
        self.env = simpy.Environment()
        self.slots: list[float | simpy.Event | None] = [None] * sim.n_events
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.rows: list[tuple] = []
        self.held: list[tuple[str, float, int]] = []  # (device, bytes, category) freed at the end
        self.deltas: list[tuple[str, float, float, int]] = [
            (device, 0.0, static, PARAMETERS) for device, static in sim.static_bytes.items()]
        # A resource only where workers share a device: a lone worker is sequential anyway.
        # Serial sharing queues on a SimPy resource; concurrent sharing is processor sharing.
        self.compute = {r: simpy.Resource(self.env, 1) for r in sim.shared_resources
                        if sim.device_law is None}
        self.streams = ({r: ProcessorSharing(self.env, sim.device_law) for r in sim.shared_resources}
                        if sim.device_law is not None else {})
        self.hosts = {h: ProcessorSharing(self.env, host_law(sim.cluster.host_contention,
                                                             sim.cluster.host_cores))
                      for h in sim.shared_hosts}
        self.interpreters = {p: ProcessorSharing(self.env, interpreter_law)
                             for p in sim.shared_processes}

    def _arrive(self, index: int, at: float) -> None:
        """Input/gradient ``index`` arrives at time ``at`` (now or later)."""
        slot = self.slots[index]
        if slot is None:
            # a plain float: the receiver tells an arrival time from an event by its exact
            # class (numpy's float64, which profile arithmetic yields, would pass unseen)
            self.slots[index] = float(at)
            return
        assert isinstance(slot, simpy.Event)  # the receiver is waiting on it
        waiting: simpy.Event = slot
        delay = at - self.env.now
        if delay <= 0:
            waiting.succeed()
        else:
            def arrive(_event: simpy.Event) -> None:
                waiting.succeed()

            self.env.timeout(delay).callbacks.append(arrive)

    def _send(self, src: int, stage: int, mb: int, send: _Send) -> None:
        index = send.event + 2 * mb
        now = end = self.env.now
        if send.link is not None:
            # The link is busy while the bytes stream (one transfer at a time per
            # direction); latency only delays the arrival, so back-to-back sends pipeline.
            start = max(now, self.link_free[send.link])
            self.link_free[send.link] = start + send.seconds
            end = start + send.seconds + send.latency_s
            self.rows.append((self.iteration, src, stage, mb, send.kind, self.origin + start,
                              self.origin + end, round(send.nbytes), send.resource))
        keeps = self.sim.cluster.sender_keeps_sends and bool(send.dst_device) and send.held
        if self.sim.track_memory and keeps:
            # the sender's tensor lives on to the step's end (see the Cluster field); its
            # stash no longer frees activations and skips sent (see Simulator._step)
            gradient = send.kind in ("SEND_B", "SEND_SB")
            if send.kind == "SEND_SB":  # made by the backward, not counted there: count it
                self.deltas.append((send.src_device, now, send.nbytes, TEMPORARIES))
            self.held.append((send.src_device, send.nbytes,
                              TEMPORARIES if gradient else ACTIVATIONS))
        elif send.dst_device and self.sim.track_memory and send.kind == "SEND_B":
            self.deltas.append((send.src_device, end, -send.nbytes, TEMPORARIES))
        posted = self.sim.cluster.receives_ahead
        if send.dst_device and self.sim.track_memory and not posted:
            # The one memory rule of a transfer, whatever the link (a free link is an
            # instant transfer, not a hand-over): the receiver holds a buffer from the
            # arrival on -- or from when it posted the receive (Cluster.receives_ahead; see
            # worker) -- to the end of the action that uses it; a gradient's buffer on the
            # sender goes free at the same moment (or at the step's end, above).
            self.deltas.append((send.dst_device, end, send.nbytes, RECEIVED))
        self._arrive(index, end)

    def worker(self, w: int):
        # The hot loop of every simulation: locals and inlined bookkeeping on purpose.
        env, sim, rows, it, origin = self.env, self.sim, self.rows, self.iteration, self.origin
        slots, deltas = self.slots, self.deltas
        track = sim.track_memory
        device = sim.resource_of[w]
        resource = self.compute.get(device)
        # what the action's work progresses on: the device's streams when they run
        # concurrently, else the host when its processes slow each other, else alone
        sharing = self.streams.get(device) or self.hosts.get(sim.cluster.devices[w].host)
        interpreter = self.interpreters.get(sim.cluster.devices[w].process)
        jitter = sim.jitter if self.rng is not None else None
        rng = self.rng
        name = f"dev{w}"
        timeout = env.timeout
        gap = sim.cluster.action_gap_s
        ahead = track and sim.cluster.receives_ahead
        reached = previous = 0.0  # when the worker moved to this step, and to the one before
        for mb, step in sim.programs[w]:
            previous, reached = reached, env.now
            if ahead and step.recv_bytes:
                # its receive was posted as the worker moved to the step before this one
                deltas.append((device, previous, step.recv_bytes, RECEIVED))
            for base in step.waits:
                index = base + 2 * mb
                slot = slots[index]
                if slot is None:
                    slot = slots[index] = env.event()
                    yield slot
                elif slot.__class__ is float and slot > env.now:
                    yield timeout(slot - env.now)
            if gap:
                yield timeout(gap)
            if resource is not None:
                req = resource.request()
                yield req
            start = env.now
            if track:
                for category, nbytes in step.alloc_start:
                    deltas.append((device, start, nbytes, category))
            seconds = step.seconds
            if jitter is not None and rng is not None:
                seconds *= jitter.stragglers.get(w, 1.0)
                if jitter.sigma:
                    seconds *= float(rng.lognormal(0.0, jitter.sigma))
            work = timeout(seconds) if sharing is None else sharing.run(seconds)
            if interpreter is not None and step.interpreter_s:
                # it ends when its work is done and so is its share under the interpreter,
                # which waits its turn behind the other threads' (threads of one process)
                held = step.interpreter_s * (seconds / step.seconds if step.seconds else 1.0)
                yield simpy.AllOf(env, [work, interpreter.run(held)])
            else:
                yield work
            end = env.now
            if track:
                for category, nbytes in step.alloc_end:
                    deltas.append((device, end, nbytes, category))
            if track and step.recompute_bytes:
                # the recomputation re-runs the forward: each layer's saved tensors exist from
                # the end of its re-run (StageCost.recompute_walk)
                r_span = (end - start) * (step.recompute_s / step.seconds if step.seconds else 0)
                for t1, share in step.recompute_walk:
                    deltas.append((device, start + r_span * t1, step.recompute_bytes * share,
                                   ACTIVATIONS))
            if track and (step.release or step.grads):
                # the backward proper walks back through the stage's layers: each layer's
                # weight gradients appear as its backward starts (a stage's first backward
                # allocates them), its saved activations go as it ends (StageCost.backward_walk)
                back = start + (end - start) * (step.recompute_s / step.seconds if step.seconds else 0)
                span = end - back
                for t0, t1, grad_share, saved_share in step.walk:
                    if step.grads and grad_share:
                        deltas.append((device, back + span * t0, step.grads * grad_share,
                                       GRADIENTS))
                    if step.release and saved_share:
                        deltas.append((device, back + span * t1, -step.release * saved_share,
                                       ACTIVATIONS))
            if step.recompute_s:
                r_end = start + (end - start) * step.recompute_s / step.seconds
                rows.append((it, w, step.stage, mb, "R", origin + start, origin + r_end, 0, name))
            rows.append((it, w, step.stage, mb, step.kind, origin + start, origin + end, 0, name))
            if resource is not None:
                resource.release(req)
            if step.send is not None:
                self._send(w, step.stage, mb, step.send)
            for extra in step.extra_sends:
                self._send(w, step.stage, mb, extra)

    def run(self) -> float:
        """Simulate; returns the iteration's end time (absolute seconds)."""
        procs = [self.env.process(self.worker(w)) for w in range(self.sim.schedule.n_devices)]
        self.env.run()
        unfinished = [w for w, p in enumerate(procs) if p.is_alive]
        if unfinished:  # cannot happen for a checked schedule; guard against a stall
            raise RuntimeError(f"simulation stalled: workers {unfinished} did not finish")
        for device, nbytes, category in self.held:  # sends kept to the step's end go now
            self.deltas.append((device, self.env.now, -nbytes, category))
        return self.origin + self.env.now

    def memory_frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Levels after each change, in time order: ``(iteration, device, time, bytes)``,
        and the same per category (:data:`MEMORY_CATEGORIES`).

        Changes at the same instant apply frees first: on one device they are sequential
        (a backward frees its stash before the next action allocates).
        """
        if not self.sim.track_memory or not self.deltas:
            return frame_from_rows([], MEMORY_COLUMNS), frame_from_rows([], CATEGORY_COLUMNS)
        devices, times, deltas, categories = zip(*self.deltas)  # one transposition, C speed
        names = sorted(set(devices))
        code = {name: i for i, name in enumerate(names)}
        dev = np.array([code[d] for d in devices], dtype=np.int64)
        cat = np.array(categories, dtype=np.int64)
        t, delta = np.array(times, dtype=float), np.array(deltas, dtype=float)
        named = np.array(names, dtype=object)
        key, when, level = _levels(dev, t, delta)
        memory = pd.DataFrame({"iteration": self.iteration, "device": named[key],
                               "time": self.origin + when, "bytes": level}, columns=MEMORY_COLUMNS)
        k = len(MEMORY_CATEGORIES)
        key, when, level = _levels(dev * k + cat, t, delta)
        by_category = pd.DataFrame({"iteration": self.iteration, "device": named[key // k],
                                    "category": np.array(MEMORY_CATEGORIES, dtype=object)[key % k],
                                    "time": self.origin + when, "bytes": level},
                                   columns=CATEGORY_COLUMNS)
        return memory, by_category


def _levels(key: np.ndarray, t: np.ndarray, delta: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Running sums of ``delta`` per integer ``key`` in time order (frees first at one
    instant): ``(key, time, level)`` of each change, sorted by key, then time."""
    order = np.lexsort((delta, t, key))  # by key, then time, frees first
    key, t, delta = key[order], t[order], delta[order]
    level = np.cumsum(delta)
    first = np.flatnonzero(np.diff(key, prepend=-1))  # where each key's run starts
    level -= np.repeat(np.concatenate([[0.0], level[first[1:] - 1]]),
                       np.diff(np.append(first, len(key))))
    return key, t, level


class Simulator:
    """Compiles plan, schedule, costs and cluster once; ``run`` simulates iterations."""

    def __init__(self, profile: Profile, plan: Plan, cluster: Cluster | None = None, *,
                 schedule: Schedule | None = None, jitter: Jitter | None = None,
                 durations: Durations | None = None, track_memory: bool = True,
                 extrapolate: bool = False):
        self.profile, self.plan = profile, plan
        self.schedule = schedule or build_schedule(plan)
        if self.schedule.n_stages != plan.n_stages:
            raise ValueError(f"schedule has {self.schedule.n_stages} stages, plan {plan.n_stages}")
        if self.schedule.n_microbatches != plan.n_microbatches:
            raise ValueError(f"schedule has {self.schedule.n_microbatches} micro-batches, plan "
                             f"{plan.n_microbatches}")
        self.cluster = cluster or Cluster.free(self.schedule.n_devices)
        if self.cluster.n_devices < self.schedule.n_devices:
            raise ValueError(f"the schedule needs {self.schedule.n_devices} devices, the cluster "
                             f"has {self.cluster.n_devices}")
        self.placement = self.schedule.placement
        self.resource_of = [d.resource for d in self.cluster.devices]
        self.costs = PlanCosts(profile, plan, extrapolate=extrapolate)
        self.jitter = jitter
        self.durations = durations or {}
        self.track_memory = track_memory
        self._compile()

    def _compile(self) -> None:
        """Turn every action into a shared :class:`_Step` with its times, bytes and send.

        Steps depend on the micro-batch only through its cost (size, checkpointing), so
        equal steps are built once: ``programs[w]`` is a list of ``(microbatch, step)``.
        """
        plan, costs = self.plan, self.costs
        n, m = plan.n_stages, plan.n_microbatches
        workers = range(self.schedule.n_devices)
        # Event (stage * m + mb) * 2 + is_backward: the stage's input (or gradient) arrived;
        # then, per skip crossing stages, 2 * m more: its tensor (or gradient) arrived.
        stage_of = {layer: s for s in range(n) for layer in plan.stage_layers(s)}
        self.skips = [(name, stage_of[a], stage_of[b]) for name, a, b in self.profile.skip_routes()
                      if stage_of[a] != stage_of[b]]
        self.skip_layer = {name: a for name, a, _ in self.profile.skip_routes()}
        #: skips whose two ends are in one stage (name, stage), and that stage's first layer
        #: is not the stashed tensor's maker (then it is the stage input, kept anyway)
        self.inner_skips = [(name, stage_of[a]) for name, a, b in self.profile.skip_routes()
                            if stage_of[a] == stage_of[b] and a != plan.stage_layers(stage_of[a]).start]
        if self.skips and self.schedule.splits_backward:
            raise ScheduleError(f"schedule {self.schedule.name!r} splits the backward, and skip "
                                f"connections cross stages here ({', '.join(n for n, *_ in self.skips)})"
                                ": not modelled yet; use a schedule with a full backward")
        self.n_events = 2 * n * m + 2 * m * len(self.skips)
        users = defaultdict(list)
        for w in workers:
            users[self.resource_of[w]].append(w)
        self.shared_resources = [r for r, ws in users.items() if len(ws) > 1]
        self.device_law = None
        if self.cluster.device_sharing == "concurrent" and self.shared_resources:
            streams = max(len(ws) for ws in users.values())
            speedup = (list(self.cluster.device_speedup)
                       or self.costs.device_speedup(streams))
            self.device_law = device_law(speedup)
        processes = defaultdict(list)
        for w in workers:
            if self.cluster.devices[w].process:
                processes[self.cluster.devices[w].process].append(w)
        self.shared_processes = [p for p, ws in processes.items() if len(ws) > 1]
        hosts = defaultdict(set)
        for w in workers:
            if self.cluster.devices[w].host:
                hosts[self.cluster.devices[w].host].add(self.resource_of[w])
        self.shared_hosts = ([h for h, devs in hosts.items() if len(devs) > 1]
                             if self.cluster.host_contention or self.cluster.host_cores else [])
        factor = 1 + plan.optimizer_state_factor
        self.static_bytes: dict[str, float] = defaultdict(float)
        for s in range(n):
            self.static_bytes[self.resource_of[self.placement[s]]] += (
                costs.stage_param_bytes(s) * factor)
        cache: dict[tuple, _Step] = {}
        #: (stage, micro-batch) whose backward is split into I and W
        self.split = {(a.stage, a.microbatch) for a in self.schedule.actions()
                      if a.kind == INPUT_GRAD}
        self.programs: list[list[tuple[int, _Step]]] = []
        for w in workers:
            grads_seen: set[int] = set()
            program = []
            for s, kind, mb in self.schedule.order[w]:
                c = costs.cost(s, mb)
                # the stage's first action that forms weight gradients allocates them
                first_backward = kind in (BACKWARD, WEIGHT_GRAD) and s not in grads_seen
                if first_backward:
                    grads_seen.add(s)
                key = (s, kind, id(c), first_backward, (s, mb) in self.split)
                if self.durations and (s, kind, mb) in self.durations:
                    step = self._step(w, s, mb, kind, c, first_backward,
                                      self.durations[(s, kind, mb)])
                    step = self._with_skips(step, w, mb)
                elif key in cache:
                    step = cache[key]
                else:
                    step = cache[key] = self._with_skips(
                        self._step(w, s, mb, kind, c, first_backward, None), w, mb)
                program.append((mb, step))
            self.programs.append(program)

    def _step(self, w: int, s: int, mb: int, kind: str, c: StageCost, first_backward: bool,
              measured: float | None) -> _Step:
        n, m = self.plan.n_stages, self.plan.n_microbatches
        # One size per stage boundary, the sender's output, for the activation and its
        # gradient alike: what one side allocates the other frees, byte for byte.
        boundary = self.costs.cost(s - 1, mb).output_bytes if s > 0 else 0.0
        overhead = self.cluster.compute_overhead_s
        device = self.resource_of[w]
        if kind == FORWARD:
            plain = (s, mb) in self.split  # its backward is split: no checkpoint hooks
            seconds = (c.fwd_s - (c.ckpt_fwd_extra_s if plain else 0.0) + overhead
                       if measured is None else measured)
            send = self._send(w, s, s + 1, "SEND_F", c.output_bytes) if s < n - 1 else None
            # transients are held while the forward runs; what it keeps stays at its end
            t = c.fwd_transient_bytes
            recv = boundary if s > 0 and self._crosses(s - 1, device) else 0.0
            return _Step(s, kind, (s * m * 2,) if s > 0 else (), seconds, 0.0,
                         _parts((TEMPORARIES, t)),
                         _parts((ACTIVATIONS, c.keep_bytes), (TEMPORARIES, -t)), send,
                         recv_bytes=recv,
                         interpreter_s=0.0 if measured is not None else seconds * c.interpreter_fwd_share)
        in_grad = boundary
        loss_grad = c.output_bytes if s == n - 1 else 0.0
        # transients of the backward: a stage's first backward allocates its gradients,
        # which stay, and its new weight gradients are them (not temporaries beside them);
        # later ones form weight gradients in temporaries before adding them
        grads = c.param_bytes if first_backward else 0.0
        # (layer by layer: at its worst, one layer's new gradients are such temporaries)
        largest = grads * max((share for _, _, share, _ in c.backward_walk), default=1.0)
        transient = max(c.bwd_transient_bytes - largest, 0.0)
        # Freed at the end of the backward (of W when split): stash, recomputed
        # activations, loss gradient, the received activation (another device's) and the
        # received gradient.  The input gradient lives on: handed to stage s-1 on this
        # device, or freed when its send ends.  The stash and the recomputed activations go
        # as the backward walks back -- but not an output sent to another device whose
        # sender keeps its sends to the step's end.
        release = c.recompute_bytes + c.keep_bytes - c.freed_first_bytes
        if self.cluster.sender_keeps_sends and s < n - 1 and self._crosses(s + 1, device):
            release -= c.output_bytes
        # (the gradient received from stage s+1: a buffer from another device, or its input
        # gradient handed over on this one)
        freed = [(TEMPORARIES, -(loss_grad + transient))]
        if s > 0 and self._crosses(s - 1, device):
            freed.append((RECEIVED, -boundary))
        if s < n - 1:
            freed.append((RECEIVED if self._crosses(s + 1, device) else TEMPORARIES,
                          -c.output_bytes))
        send = self._send(w, s, s - 1, "SEND_B", boundary) if s > 0 else None
        waits = (s * m * 2 + 1,) if s < n - 1 else ()
        # (a checkpointed loss stage frees the loss's saved tensors before recomputing)
        # The recomputed activations appear layer by layer as the recomputation runs (see
        # the worker, _Step.recompute_bytes) -- but for as much as the loss's saved tensors
        # it frees first: that part takes their place at the start (one instant, one net
        # change: frees first at an instant would otherwise take them before F kept them)
        in_place = min(c.recompute_bytes, c.freed_first_bytes)
        gradient_start = [(ACTIVATIONS, in_place - c.freed_first_bytes),
                          (TEMPORARIES, in_grad + loss_grad)]
        if kind == WEIGHT_GRAD:
            # W: weight gradients from the output gradients I kept, then everything goes
            seconds = c.bwd_weight_s + overhead if measured is None else measured
            return _Step(s, kind, (), seconds, 0.0,
                         _parts((TEMPORARIES, transient)),
                         _parts(*freed, (TEMPORARIES, -c.w_pending_bytes)), None,
                         release=release, grads=grads, walk=c.backward_walk or _WHOLE,
                         interpreter_s=0.0 if measured is not None else seconds * c.interpreter_bwd_share)
        recompute = c.recompute_s
        if kind == INPUT_GRAD:
            # I: the input gradient (after recomputing, when checkpointed); the stash, the
            # received tensors and the output gradients for W stay until W
            seconds = c.bwd_input_s + recompute + overhead
            alloc_start = _parts(*gradient_start, (TEMPORARIES, transient))
            alloc_end = _parts((TEMPORARIES, c.w_pending_bytes - transient))
            release = 0.0
        else:
            seconds = c.bwd_s + recompute + overhead
            alloc_start = _parts(*gradient_start, (TEMPORARIES, transient))
            alloc_end = _parts(*freed)
        # (a recomputation is a forward: Python issuing, under the interpreter)
        held = recompute * c.interpreter_fwd_share + (seconds - recompute) * c.interpreter_bwd_share
        if measured is not None:
            seconds, recompute, held = measured, min(recompute, measured), 0.0
        recv = c.output_bytes if s < n - 1 and self._crosses(s + 1, device) else 0.0
        return _Step(s, kind, waits, seconds, recompute, alloc_start, alloc_end, send,
                     release=release, recv_bytes=recv,
                     grads=grads if kind == BACKWARD else 0.0, walk=c.backward_walk or _WHOLE,
                     interpreter_s=held, recompute_bytes=c.recompute_bytes - in_place,
                     recompute_walk=c.recompute_walk or ((0.0, 1.0),))

    def _crosses(self, stage: int, device: str) -> bool:
        """Whether ``stage`` runs on another physical device than ``device``."""
        return self.resource_of[self.placement[stage]] != device

    def _with_skips(self, step: _Step, w: int, mb: int) -> _Step:
        """Add the skip connections that start or end at this step's stage.

        The stashing stage sends the skip tensor straight to the popping stage after its
        forward and keeps it until its backward, which waits for the skip's gradient; the
        popping stage waits for it before its forward and frees it at the end of that
        forward (a merge by addition or concatenation saves nothing), or at the end of its
        backward when the micro-batch is checkpointed and recomputes; the gradient goes
        straight back.  The skip tensor costs the stashing stage nothing more when its
        stash already holds it (the next layer saves it as its input, or it is the stage's
        output); with a transport that keeps its sends, it lives to the step's end.
        """
        if not self.skips and not self.inner_skips:
            return step
        release = step.release
        n, m = self.plan.n_stages, self.plan.n_microbatches
        size = self.plan.micro_batch_sizes[mb]
        waits, sends, alloc_end = list(step.waits), list(step.extra_sends), list(step.alloc_end)
        recv = step.recv_bytes
        for r, (name, a, b) in enumerate(self.skips):
            nbytes = self.profile.skip_bytes(name, size, extrapolate=self.costs.extrapolate)
            event = 2 * n * m + 2 * m * r
            cross = self.resource_of[self.placement[a]] != self.resource_of[self.placement[b]]
            ckpt = self.plan.checkpointed(mb)
            # only the stashing stage asks whether its stash already holds the skip (a
            # checkpointed micro-batch's stash holds its output alone)
            stashed = step.stage == a and self._in_stash(name, a, size, nbytes, ckpt)
            keeps = cross and self.cluster.sender_keeps_sends
            # a skip stashed by the stage's last layer is its output (one storage): when the
            # output is sent to another device and kept, the skip is kept with it
            a_device = self.resource_of[self.placement[a]]
            with_output = (keeps and a < n - 1 and self._crosses(a + 1, a_device)
                           and self.skip_layer[name] + 1 >= self.plan.stage_layers(a).stop)
            if step.stage == a and step.kind == FORWARD:
                send = self._send(w, a, b, "SEND_S", nbytes, event)
                sends.append(send._replace(held=False) if with_output else send)
                alloc_end.append((ACTIVATIONS, 0.0 if stashed else nbytes))
            elif step.stage == b and step.kind == FORWARD:
                waits.append(event)
                recv += nbytes if cross else 0.0  # its buffer, posted ahead or on arrival
                alloc_end.append((RECEIVED, -nbytes if cross and not ckpt else 0.0))
            elif step.stage == b:
                sends.append(self._send(w, b, a, "SEND_SB", nbytes, event + 1))
                alloc_end.append((RECEIVED, -nbytes if cross and ckpt else 0.0))
            elif step.stage == a:
                waits.append(event + 1)
                # the skip's gradient: a buffer from its posting (or arrival) to the end of
                # the backward, which takes it beside the output's gradient
                recv += nbytes if cross else 0.0
                alloc_end.append((RECEIVED, -nbytes if cross else 0.0))
                # freed by the stashing stage's backward, or at the step's end if sent
                # to another device whose transport keeps its sends (see _Run._send)
                if keeps and stashed and not with_output:
                    release -= nbytes
                elif not keeps and not stashed:
                    alloc_end.append((ACTIVATIONS, -nbytes))
        if self.plan.checkpointed(mb):
            for name, stage in self.inner_skips:
                if stage != step.stage:
                    continue
                # A checkpointed forward saves nothing, yet the executor's skip tracker
                # keeps what the stage's Stash layers stashed (its recomputation pops the
                # first forward's tensors, executor.skip): from the forward to the backward
                nbytes = self.profile.skip_bytes(name, size, extrapolate=self.costs.extrapolate)
                if step.kind == FORWARD:
                    alloc_end.append((ACTIVATIONS, nbytes))
                elif step.kind in (BACKWARD, WEIGHT_GRAD):  # the end of the gradient's work
                    alloc_end.append((ACTIVATIONS, -nbytes))
        return step._replace(waits=tuple(waits), extra_sends=tuple(sends),
                             alloc_end=_parts(*alloc_end), release=release, recv_bytes=recv)

    def _in_stash(self, name: str, stage: int, size: float, nbytes: float,
                  checkpointed: bool) -> bool:
        """Whether the stashing stage's stash already holds skip ``name``'s tensor."""
        after = self.skip_layer[name] + 1  # the layer that reads what the Stash passes on
        layers = self.plan.stage_layers(stage)
        if after >= layers.stop or after - 1 == layers.start:
            return True  # the stage's output or input: kept until its backward anyway
        if checkpointed:
            return False  # a checkpointed stash: the stage's input and output alone
        saved = self.profile.at(after, size, extrapolate=self.costs.extrapolate)
        return saved["saved_input_bytes"] >= 0.99 * nbytes

    def _send(self, src: int, src_stage: int, dst_stage: int, kind: str, nbytes: float,
              event: int | None = None) -> _Send:
        m = self.plan.n_microbatches
        dst = self.placement[dst_stage]
        if event is None:
            event = dst_stage * m * 2 + (kind == "SEND_B")
        src_dev, dst_dev = self.resource_of[src], self.resource_of[dst]
        # memory moves unless both stages are on one physical device (a hand-over); a
        # skip's gradient has no receive buffer (consumed at once; see _Run._send)
        holds = dst_dev != src_dev
        dst_memory = dst_dev if holds else ""
        link = self.cluster.link_between(src, dst) if src != dst else FREE
        over = self.cluster.transfer_overhead_s
        if src == dst or (link is FREE and not over):
            return _Send(kind, event, None, 0.0, 0.0, nbytes, src_dev, dst_memory, "")
        occupancy = over + link.seconds(nbytes) - link.latency_s
        return _Send(kind, event, (src, dst), occupancy, link.latency_s, nbytes, src_dev,
                     dst_memory, f"dev{src}->dev{dst}")

    def run(self, iterations: int = 1) -> Trace:
        rng = np.random.default_rng(self.jitter.seed) if self.jitter else None
        rows: list[tuple] = []
        memories, categories = [], []
        origin = 0.0
        for it in range(iterations):
            run = _Run(self, it, origin, rng)
            origin = run.run()
            rows += run.rows
            memory, by_category = run.memory_frames()
            memories.append(memory)
            categories.append(by_category)
        actions = frame_from_rows(rows, ACTION_COLUMNS)
        memory = memories[0] if len(memories) == 1 else pd.concat(memories, ignore_index=True)
        by_category = None
        if self.track_memory:
            by_category = (categories[0] if len(categories) == 1
                           else pd.concat(categories, ignore_index=True))
        meta = {
            "source": "simulated",
            "batch_size": self.plan.batch_size,
            "plan": self.plan.to_dict(),
            "schedule": self.schedule.name,
            "cluster": self.cluster.name,
            "profile": self.profile.source,
            "devices": {w: d.resource for w, d in enumerate(self.cluster.devices)},
        }
        return Trace(actions, memory, meta, by_category)


def simulate(profile: Profile, plan: Plan, cluster: Cluster | None = None, *,
             schedule: Schedule | None = None, iterations: int = 1, jitter: Jitter | None = None,
             durations: Durations | None = None, track_memory: bool = True,
             extrapolate: bool = False) -> Trace:
    """Predict ``iterations`` training steps of ``plan`` on ``cluster`` from ``profile``.

    ``schedule`` defaults to the one the plan names (pass one to simulate a custom or
    imported schedule); ``cluster`` defaults to free links with no overheads.
    ``durations`` replaces profile times of individual actions (replaying a measured
    run).  Returns a :class:`pipesim.trace.Trace`; feed it to :func:`pipesim.metrics`.
    """
    sim = Simulator(profile, plan, cluster, schedule=schedule, jitter=jitter,
                    durations=durations, track_memory=track_memory, extrapolate=extrapolate)
    return sim.run(iterations)


__all__ = ["Durations", "Jitter", "Simulator", "simulate"]
