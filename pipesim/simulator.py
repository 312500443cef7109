"""The SimPy model of a pipeline: a Schedule run on a Cluster with Profile costs.

Each worker is a SimPy process that walks its action list in order.  An action starts
when (a) the worker reached it, (b) its inputs arrived, and (c) its physical device's
compute is free (workers sharing a device serially queue on one resource; workers whose
streams run concurrently start at once and share the device's speed instead).  A finished F(s, m)
sends its output to stage s+1, a finished B(s, m) its input gradient to stage s-1, over
the link between the two workers: each direction of a link streams one transfer's bytes
at a time (a copy stream / an async send), so transfers overlap compute but not each
other; latency delays arrival without occupying the link.  Where the transport writes
from the sender's own thread (``Cluster.blocking_sends``: gloo over TCP), the sender
moves to its next action only once its bytes are written::

    streamed   F(0,0) |====|F(0,1) |====|           blocking   F(0,0) |====|      |====|
    link              |--send--|                               link   |--send--|

Time of an action: profile seconds at the micro-batch's real size, plus the cluster's
per-action overhead; a checkpointed backward also re-runs the forward.  An action starts
the cluster's ``action_gap_s`` after its worker reaches it if its input is there, else
``wakeup_gap_s`` after the input arrives (a blocked thread woken).  Where the cluster
measured its stage's own executor work between actions in place, a ready action's gap
is that much longer than the calibration pipeline's (less: shorter;
:meth:`pipesim.cluster.Cluster.executor_gap`); a blocked worker did that work before it
blocked, so its wake-up gap stays::

    ready     prev |==|..gap + (stage's - calibration's)..|== F ==|
    blocked   prev |==|work|  ...waits...  ^input .wakeup.|== F ==|

and where the cluster measured how a wake-up grows with the wait before it
(:attr:`pipesim.cluster.Cluster.wakeup_curve`), the longer the worker waited since its
previous action the longer its wake-up.

Where the cluster has measured idle costs (:attr:`pipesim.cluster.Cluster.idle_costs`, optional), a forward or
backward also pays what its worker's wait since its last action cost it (read off the
measured curve at that idle) -- but where workers share a device and another worker's
action ran on it meanwhile, nothing: the device never idled::

    own cores   t0 |F0|.......idle.......|B0'|      B0' pays the curve at the idle
                t1     |F1|B1|
    one core    t0 |F0|                 |B0|        the core ran F1, B1 meanwhile:
                t1     |F1|B1|                     B0 runs at the profile's pace

A forward right after a backward that waited pays the larger of its own wait's cost and
what the cluster measured for a forward after such a backward (kind ``"FB"`` of
:class:`pipesim.readings.IdleCost`, read at the backward's wait; none where not measured)::

    1F1B        t0 |F1|send|..wait..|B0|F2'|     F2' pays the "FB" curve at the wait

Where messages cost their receiver (:attr:`pipesim.cluster.Cluster.landing_s`), each one
that arrives while its receiving worker computes makes that action longer by its cost
(the rank's communication thread reading it on the action's core); one the worker waits
for costs nothing here::

    worker 0   |== F0 ==|send|== F1 ==|send|
    worker 1        |== F(1,0) ==+|== F(1,1) ==+|      +: F0's, F1's message landing

Optional jitter multiplies each duration by a seeded log-normal factor (and a
straggler's factor).  While actions overlap on a concurrently shared device, or on a host whose processes slow
each other, their work progresses at the rate :mod:`pipesim.contention` gives: this
engine decides when an action runs, that module how fast.  Workers that are threads of
one process also hold its interpreter for their measured share of each action, one at a
time; an action then ends when both its work and that share are done.  Their backwards on
an accelerator are issued by autograd's one thread for that device instead (its
``engine``, :attr:`pipesim.cluster.Device.engine`), in turn::

    worker 0   B(0, m)  |====....====|        backward work on the device (streams)
    worker 1   B(1, m')      |===....===|     and the engine's issue, one at a time:
    engine     0 0 0 0 1 1 1 1 1 1 0 0        the thread that makes more nodes first

That thread takes the ready node with the highest sequence number, and a worker thread's
numbers grow by the autograd nodes each of its forwards creates: the worker whose stages
create more (the profile's ``autograd_nodes``) outruns the other's numbers, micro-batch
after micro-batch, so its backward is served whenever it has one and the other's waits
(equal counts share the thread; a profile without the column: all equal).  In the
recorded H100 grid a later backward on the other thread finished first in 0.01-0.06 of
the overlaps for MLP [5,4] (stage 0 making 15 nodes a micro-batch, stage 1 13), 0.42-0.61
for MLP [1,8] checkpointed (3 against 25) and 0.39 for GPT [5,5] checkpointed (127
against 132), where stage 0 arriving second overtook MLP [5,4]'s stage 1 every time.

A checkpointed backward there first recomputes: torch.utils.checkpoint re-runs the
forward from the engine's thread, Python that holds the interpreter as a forward does,
so it takes turns with the other threads' forwards, and the backward proper follows::

    worker 0   F(0, m+1)  |====----====|         forward issue under the interpreter
    worker 1   B(1, m)    |R--==--==|=B=====|    R: its recomputation, engine and
    interpreter           0 0 1 0 1 0 1          interpreter both, in turn with F

That re-run happens inside one node of autograd's thread, which serves nothing else until
it has issued it: two stages' recomputations are issued one after the other, and the other
stage's backward proper waits meanwhile (:attr:`pipesim.cluster.Cluster.recompute_holds_engine`;
the re-run's kernels run on once issued)::

    worker 0   B(0, m)    |R issue|..........|== B proper ==|
    worker 1   B(1, m')   ........|R issue|===B proper===|      R after R, never beside

and where the profile measured it (:meth:`pipesim.profile.Profile.engine_interpreter_share`),
the backward proper holds the interpreter too for that share of its seconds: the
checkpoint's unpack hooks, Python run for each saved tensor it reads.

Where the cluster says so (:attr:`pipesim.cluster.Cluster.thread_pairs`) the threads of
one process share instead by pairs the profiler measured pass beside pass: an action
progresses at the rate its pass has beside the pass the other thread runs
(:class:`pipesim.contention.PairSharing`), and none of the turns above is taken -- the
pairs were measured with the interpreter, the engine and the device shared.

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
                from when its receive is posted, Cluster.receives_ahead: at the step's
                start with Cluster.receives_at_start), + output
                bytes when a gradient arrives; freed at the end of B(s, m); skips and
                their gradients alike (see pipesim.steps.StepBuilder.with_skips)
    transient   during F: its temporaries (profiled ``fwd_transient_bytes``); during B:
                the input gradient being produced, the loss gradient on the last stage
                (to the end of its last layer's backward), and the backward's own
                temporaries and weight gradients being formed (``bwd_transient_bytes``)
    sent        with Cluster.sender_keeps_sends, what a worker sends to another device
                lives on to the step's end (one storage held once)

On an accelerator an action's changes run along its host's issue, its host's share of the
action (the caching allocator counts from the call that makes a tensor to its release on
the host, not along the kernels): a device-bound backward frees early::

    device   B(s, m) |=============================|
    host     issue   |=======|                          (host_bwd_s of its seconds)
    memory   walk    |+grads -saved|                    all of it done here

Each iteration's backward::

    B(s, m) on a stage of layers a..c, checkpointed:
      |--- recompute a, b, c ---|--- backward c ---|-- b --|---- a ----|
      +a      +b      +c         +grads c   -c      +grads b  -b  +grads a  -a
      (+grads only on the stage's first backward; -x: what layer x saved)
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import simpy

from pipesim.cluster import Cluster
from pipesim.contention import (
    PairSharing,
    ProcessorSharing,
    device_law,
    host_law,
    interpreter_law,
)
from pipesim.costs import PlanCosts
from pipesim.errors import ClusterError
from pipesim.plan import Plan
from pipesim.profile import PAIR_KINDS, Profile
from pipesim.readings import read_curve
from pipesim.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT_GRAD,
    Schedule,
    build_schedule,
)
from pipesim.steps import (
    ACTIVATIONS,
    GRADIENTS,
    MEMORY_CATEGORIES,
    PARAMETERS,
    RECEIVED,
    TEMPORARIES,
    Send,
    Step,
    StepBuilder,
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
    """What-if costs: each duration x lognormal(0, sigma) x stragglers.get(worker, 1)
    x scale.get((stage, kind, microbatch), 1).

    Unlike ``durations`` (a replay: the whole duration given, contention included), a
    ``scale`` changes what an action costs and leaves how it shares its worker's host,
    device, interpreter and engine to the model: e.g. each action at the cost it was
    measured to have alone (:func:`pipesim.compare.alone_scale`).
    """

    sigma: float = 0.0
    stragglers: dict[int, float] = field(default_factory=dict)
    seed: int = 0
    scale: dict[tuple[int, str, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (np.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"jitter sigma must be a finite number of at least 0, got {self.sigma}")
        for what, factors in (("straggler", self.stragglers), ("scale", self.scale)):
            bad = {k: v for k, v in factors.items() if not (np.isfinite(v) and v > 0)}
            if bad:
                raise ValueError(f"jitter {what} factors must be finite and above 0, got {bad}")


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
        # (a measured slowdown beyond the law's, Step.host_slowdown, slows a step further)
        self.hosts = {h: ProcessorSharing(self.env, host_law(sim.cluster.host_contention,
                                                             sim.cluster.host_cores))
                      for h in sim.shared_hosts}
        self.interpreters = {p: ProcessorSharing(self.env, interpreter_law)
                             for p in sim.shared_processes}
        self.engines = {e: ProcessorSharing(self.env, interpreter_law) for e in sim.shared_engines}
        # a recomputation has autograd's thread to itself, one at a time
        # (Cluster.recompute_holds_engine)
        self.recomputing = ({e: simpy.Resource(self.env, 1) for e in sim.shared_engines}
                            if sim.cluster.recompute_holds_engine else {})
        self.pairs = {p: PairSharing(self.env, PAIR_KINDS) for p in sim.paired_processes}
        # where workers share a device: how many of its actions run now, and when its last
        # one ended (-1: none yet) -- whether it idled since a worker's own last action,
        # which alone makes that worker pay its idle costs
        self.device_busy = {r: [0, -1.0] for r in sim.shared_resources}
        # each worker's incoming messages, (arrival, what it costs an action it lands in),
        # in arrival order, where messages cost their receiver (Cluster.landing_s)
        self.landings: list[list[tuple[float, float]]] | None = (
            [[] for _ in sim.cluster.devices]
            if sim.cluster.landing_s or sim.cluster.landing_byte_s else None)

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

    def _send(self, src: int, stage: int, mb: int, send: Send, not_before: float) -> float:
        """Send ``send`` from worker ``src``, its bytes streaming from ``not_before`` on
        at the earliest; returns when they are written (the arrival less the latency)."""
        index = send.event + 2 * mb
        now = end = written = self.env.now
        if send.link is not None:
            # The link is busy while the bytes stream (one transfer at a time per
            # direction); latency only delays the arrival, so back-to-back sends pipeline.
            start = max(not_before, self.link_free[send.link])
            written = self.link_free[send.link] = start + send.seconds
            end = start + send.seconds + send.latency_s
            self.rows.append((self.iteration, src, stage, mb, send.kind, self.origin + start,
                              self.origin + end, round(send.nbytes), send.resource))
        keeps = self.sim.cluster.sender_keeps_sends and bool(send.dst_device) and send.held
        if self.sim.track_memory and keeps:
            # the sender's tensor lives on to the step's end (see the Cluster field); its
            # stash no longer frees activations and skips sent (see StepBuilder.step)
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
        if self.landings is not None and send.receiver not in (src, -1):
            cluster = self.sim.cluster
            insort(self.landings[send.receiver],
                   (end, cluster.landing_s + cluster.landing_byte_s * send.nbytes))
        self._arrive(index, end)
        return written

    def _landed(self, w: int, since: float, until: float) -> float:
        """Seconds the messages arriving at worker ``w`` in (``since``, ``until``] add to
        the action it computes meanwhile (:attr:`pipesim.cluster.Cluster.landing_s`)."""
        assert self.landings is not None
        arrivals = self.landings[w]
        first = bisect_right(arrivals, (since, math.inf))
        last = bisect_right(arrivals, (until, math.inf))
        return sum(cost for _, cost in arrivals[first:last])

    def worker(self, w: int):
        # The hot loop of every simulation: locals and inlined bookkeeping on purpose.
        env, sim, rows, it, origin = self.env, self.sim, self.rows, self.iteration, self.origin
        slots, deltas = self.slots, self.deltas
        track = sim.track_memory
        device = sim.resource_of[w]
        # (threads of one process sharing it by measured pairs, Cluster.thread_pairs: the
        # pairs hold the device's sharing too, so such a worker takes no turns on it)
        pairs = self.pairs.get(sim.cluster.devices[w].process)
        resource = self.compute.get(device) if pairs is None else None
        busy = self.device_busy.get(device)  # [running, last end] where workers share it
        # what the action's work progresses on: the device's streams when they run
        # concurrently, else the host when its processes slow each other, else alone
        # (seconds of work, its slowdown while another rank of the host computes) -> event
        progress: Callable[[float, float], simpy.Event]
        streams = self.streams.get(device)
        if streams is not None:
            progress = lambda work, _slowdown: streams.run(work)  # noqa: E731
        elif (host := self.hosts.get(sim.cluster.devices[w].host)) is not None:
            progress = host.run
        else:
            progress = lambda work, _slowdown: env.timeout(work)  # noqa: E731
        interpreter = self.interpreters.get(sim.cluster.devices[w].process)
        engine = self.engines.get(sim.cluster.devices[w].engine)
        recomputing = self.recomputing.get(sim.cluster.devices[w].engine)
        # where the executor's gaps between actions hold the interpreter
        # (Cluster.gaps_hold_interpreter): by the pairs as a forward, else in turn on it
        hold_gap: Callable[[float, Step], simpy.Event] | None = None
        if sim.cluster.gaps_hold_interpreter:
            if pairs is not None:
                hold_gap = lambda pause, s: pairs.run_pass(pause, "F", s.gap_pair_row)  # noqa: E731
            elif interpreter is not None:
                hold_gap = lambda pause, _s: interpreter.run(pause)  # noqa: E731
        priority = sim.engine_priority[w]
        jitter = sim.jitter if self.rng is not None else None
        rng = self.rng
        name = f"dev{w}"
        timeout = env.timeout
        gap = sim.cluster.action_gap_s
        wakeup = sim.cluster.wakeup_s
        # (a wake-up grows with the wait before it, where the cluster measured how)
        wakeup_after = sim.cluster.wakeup_after if sim.cluster.wakeup_curve else None
        blocking = sim.cluster.blocking_sends
        ahead = track and sim.cluster.receives_ahead
        at_start = sim.cluster.receives_at_start
        # (posted once the action before has its inputs, unless that action belongs to a
        # micro-batch whose backward is split: Cluster.receives_after_inputs; none of
        # that to follow where every receive goes at the step's start)
        split = (sim.steps.split if ahead and sim.cluster.receives_after_inputs
                 and not at_start else None)
        # (an accelerator's host runs ahead of its device: Cluster.issue_ahead)
        accelerator = sim.cluster.devices[w].on_accelerator
        issue_ahead = sim.cluster.issue_ahead and accelerator
        issued = [0.0]  # when the action's host-side work (engine, interpreter) was done
        landed = self._landed if self.landings is not None else None

        def note(_event: simpy.Event) -> None:
            issued[0] = max(issued[0], env.now)

        def host_side(event: simpy.Event) -> simpy.Event:
            """``event``, a part of the action its host issues: noted when it is done."""
            if issue_ahead:
                event.callbacks.append(note)
            return event

        reached = previous = 0.0  # when the worker moved to this step, and to the one before
        posted = 0.0  # when it posted the receives of the step after the one it is at
        idled = -1.0  # when the worker's last compute action ended (-1: none yet)
        # the wait before that action where it was a backward (-1: it was not): what the
        # forward right after it pays for too (Step.after_wait_curve)
        backward_waited = -1.0
        host_free = 0.0  # when its host went on from its last action (issue_ahead)
        # the stage and kind of its last action (Step.run_on_scale: a run of one kind)
        last_stage, last_kind = -1, ""
        for mb, step in sim.programs[w]:
            previous, reached = reached, env.now
            if ahead and step.recv_bytes:
                # its receive was posted as the step started (Cluster.receives_at_start), as
                # the worker moved to the step before this one, or as that one started
                # (Cluster.receives_after_inputs)
                deltas.append((device, 0.0 if at_start else previous if split is None
                               else posted, step.recv_bytes, RECEIVED))
            blocked = False  # whether the worker reached the step before its input
            arrived = 0.0  # when the last of its inputs that were there arrived
            for base in step.waits:
                index = base + 2 * mb
                slot = slots[index]
                if slot is None:
                    slot = slots[index] = env.event()
                    yield slot
                    blocked = True
                elif slot.__class__ is float:
                    if slot > env.now:
                        yield timeout(slot - env.now)
                        blocked = True
                    elif issue_ahead:
                        arrived = max(arrived, slot)
            # (its stage's own executor work, measured in place, where its input was there:
            # a worker that blocked on its input did that work before it blocked)
            if not blocked:
                pause = gap + step.gap_s
                if issue_ahead:
                    # its host went on when it had issued the last action, and waited for
                    # an input that came after that (a wake-up); the device runs on
                    if arrived > host_free + pause:
                        pause = arrived - host_free + (
                            wakeup_after(arrived - host_free) if wakeup_after is not None
                            else wakeup)
                    pause = host_free + pause - env.now
            elif wakeup_after is not None and idled >= 0:
                pause = wakeup_after(env.now - idled)
            else:
                pause = wakeup
            if pause > 0:
                yield timeout(pause) if hold_gap is None else hold_gap(pause, step)
            if resource is not None:
                req = resource.request()
                yield req
            start = env.now
            if split is not None:
                posted = (start if step.kind in (FORWARD, BACKWARD)
                          and (step.stage, mb) not in split else reached)
            if track:
                for category, nbytes in step.alloc_start:
                    deltas.append((device, start, nbytes, category))
            seconds = step.seconds
            if (step.idle_curve and idled >= 0
                    and (busy is None or (not busy[0] and busy[1] <= idled))):
                # what faded from the caches while the worker waited (Cluster.idle_costs);
                # not where another worker's action ran on a device they share meanwhile
                # (stage threads on one core): that device never idled, and runs at the
                # steady pace the profile measures
                faded = read_curve(step.idle_curve, start - idled)
                if step.after_wait_curve and backward_waited >= 0:
                    # a forward right after a backward that waited: what faded meanwhile
                    # from what the forward touches, measured in place (kind "FB")
                    faded = max(faded, read_curve(step.after_wait_curve, backward_waited))
                seconds = max(seconds + faded, 0.0)
            backward_waited = start - idled if step.kind == BACKWARD and idled >= 0 else -1.0
            if step.kind == last_kind and step.stage == last_stage:
                # a forward after a forward, a backward after a backward, at the pace in
                # place (the idle curve's baseline) scaled (Cluster.run_on_costs)
                seconds *= step.run_on_scale
            last_stage, last_kind = step.stage, step.kind
            if busy is not None:
                busy[0] += 1
            if jitter is not None and rng is not None:
                seconds *= jitter.stragglers.get(w, 1.0)
                if jitter.scale:
                    seconds *= jitter.scale.get((step.stage, step.kind, mb), 1.0)
                if jitter.sigma:
                    seconds *= float(rng.lognormal(0.0, jitter.sigma))
            scale = seconds / step.seconds if step.seconds else 1.0
            recomputed = -1.0  # when its recomputation ended, where the engine ran it apart
            r_begin = start  # when it began: later where it waited for autograd's thread
            if pairs is not None:
                # slowed by what the other threads run beside it, as measured pass by pass
                # (the interpreter, the engine and the device in one figure)
                yield pairs.run_pass(seconds, step.pair_kind, step.pair_row)
            elif engine is not None and step.engine_s:
                # a backward issued by autograd's thread for the device (_on_engine)
                r_begin, recomputed = yield from self._on_engine(
                    step, seconds, scale, start, progress, host_side, engine,
                    recomputing, interpreter, priority)
            elif interpreter is not None and step.interpreter_s:
                # it ends when its work is done and so is its share under the interpreter,
                # which waits its turn behind the other threads' (threads of one process)
                yield simpy.AllOf(env, [progress(seconds, step.host_slowdown), host_side(
                    interpreter.run(step.interpreter_s * scale, step.interpreter_slowdown))])
            else:
                yield progress(seconds, step.host_slowdown)
            if landed is not None:
                # the messages that landed while it computed, and in that time, and so on
                since = start
                while (landing := landed(w, since, env.now)) > 0:
                    since = env.now
                    yield timeout(landing)
            end = idled = env.now
            if busy is not None:
                busy[0] -= 1
                busy[1] = end
            if issue_ahead:
                # its host was free once it had issued it, at the latest when it ended
                host_free = (min(end, max(start + step.issue_s * scale, issued[0]))
                             if step.issue_s else end)
                issued[0] = 0.0
            # the recomputation's end: as timed, else its share of the action (none: start)
            r_end = (recomputed if recomputed >= 0 else start if not step.recompute_s
                     else start + (end - start) * step.recompute_s / step.seconds)
            if track:
                self._memory_changes(device, step, accelerator, r_begin, r_end, end)
            if step.recompute_s:
                rows.append((it, w, step.stage, mb, "R", origin + r_begin, origin + r_end, 0, name))
            rows.append((it, w, step.stage, mb, step.kind, origin + start, origin + end, 0, name))
            if resource is not None:
                resource.release(req)
            # its sends, one after another; a blocking transport holds the worker until
            # the last one's bytes are written (Cluster.blocking_sends)
            written = env.now
            if step.send is not None:
                written = self._send(w, step.stage, mb, step.send, written if blocking else end)
            for extra in step.extra_sends:
                written = max(written, self._send(w, step.stage, mb, extra,
                                                  written if blocking else end))
            if blocking and written > env.now:
                yield timeout(written - env.now)

    def _on_engine(self, step: Step, seconds: float, scale: float, start: float,
                   progress: Callable[[float, float], simpy.Event],
                   host_side: Callable[[simpy.Event], simpy.Event],
                   engine: ProcessorSharing, recomputing: simpy.Resource | None,
                   interpreter: ProcessorSharing | None, priority: float):
        """Run a backward (``step``, ``seconds`` of work, its step's seconds times ``scale``)
        that autograd's thread for an accelerator issues, from ``start``: a SimPy process
        body (``yield from`` it) that returns ``(r_begin, recomputed)``, when its
        recomputation began (``start`` unless it waited for autograd's thread) and ended
        (-1: no recomputation apart).

        It ends when its work is done (``progress``: on the device's streams) and autograd's
        thread (``engine``) has issued it, in turn with the other threads' backwards: for
        the measured share where the profile has one (two threads' backwards on one device
        measured together are this thread's turns), else for its host seconds; by
        ``priority``, the autograd nodes its worker's forwards create (module doc).
        Checkpointed, that thread first re-runs the forward, Python that holds the
        interpreter as a forward does (in turn with the other threads' forwards), then
        issues the backward proper -- where that thread runs the re-run to itself
        (``recomputing``: one at a time, serving no other backward meanwhile), or where the
        interpreter's part is known; else the recomputation is the first part of the
        backward's one turn::

            engine      |R issue|== B proper issue ==|      (other threads' turns between)
            device      |== R kernels ==|===== B proper =====|
            interpreter |R's Python|         |hooks|          (checkpointed only)

        ``host_side`` marks each host part, for the host that goes on once it has issued
        (:attr:`pipesim.cluster.Cluster.issue_ahead`).
        """
        env = self.env
        r_begin, recomputed = start, -1.0
        held = (step.interpreter_s or step.engine_s) * scale
        gil = interpreter if step.engine_interpreter_s > 0 else None
        if step.recompute_s and (gil is not None or recomputing is not None):
            r, r_held = step.recompute_s * scale, step.engine_recompute_s * scale
            if step.interpreter_s and seconds > 0:
                # a share measured for the whole checkpointed backward: the recomputation
                # holds its part of it, the backward proper the rest (not the whole share
                # again on top of the recomputation's issue)
                r_held = r * held / seconds
            turn = None
            if recomputing is not None:
                # autograd's thread to itself while it issues the re-run forward: after
                # another stage's recomputation, serving no other backward
                turn = recomputing.request()
                yield turn
                r_begin = env.now
                engine.pause()
            kernels = progress(r, step.host_slowdown)
            issue = [host_side(
                env.timeout(r_held) if recomputing is not None
                else engine.run(r_held, step.interpreter_slowdown, priority))]
            if gil is not None:
                issue.append(host_side(gil.run(step.engine_interpreter_s * scale,
                                               step.interpreter_slowdown)))
            if recomputing is not None and turn is not None:
                # (the thread goes on once it has issued it; the device runs on)
                yield simpy.AllOf(env, issue)
                engine.resume()
                recomputing.release(turn)
            yield simpy.AllOf(env, [kernels, *issue])
            seconds, held = seconds - r, max(held - r_held, 0.0)
            recomputed = env.now
        proper = [progress(seconds, step.host_slowdown),
                  host_side(engine.run(held, step.interpreter_slowdown, priority))]
        if interpreter is not None and step.engine_hooks_s:
            # the checkpoint's unpack hooks: Python, in turn with the other threads
            proper.append(host_side(interpreter.run(step.engine_hooks_s * scale,
                                                    step.interpreter_slowdown)))
        yield simpy.AllOf(env, proper)
        return r_begin, recomputed

    def _memory_changes(self, device: str, step: Step, accelerator: bool, r_begin: float,
                        r_end: float, end: float) -> None:
        """The memory changes of an action of ``step`` that ran until ``end`` (seconds of
        the run), its recomputation from ``r_begin`` to ``r_end`` (``r_begin`` is its
        start where it recomputed nothing), appended to ``self.deltas``: what it keeps
        and frees as it ends, its recomputation's activations as they are made again, the
        loss's gradient, and the backward's walk back through the stage's layers."""
        deltas = self.deltas
        # An accelerator's allocator counts a tensor from the host's call that makes it
        # to the host's release of it (stream-ordered reuse), not along the kernels: an
        # action's memory changes run along its host's issue -- its host's share of the
        # action (stretched as the action is: sharing the device slows a launch-bound
        # host as much as its kernels), all of a launch-bound action, the start of a
        # device-bound one (two stage threads' checkpointed backwards then hold their
        # recomputed activations one after the other, as measured)
        mem_end, mem_r_end = end, r_end
        if accelerator and 0 < step.issue_s < step.seconds:
            shrink = step.issue_s / step.seconds
            # (from when it began: a recomputation that waited for autograd's thread
            # issued nothing meanwhile)
            mem_end = r_begin + (end - r_begin) * shrink
            mem_r_end = r_begin + (r_end - r_begin) * shrink
        for category, nbytes in step.alloc_end:
            deltas.append((device, mem_end, nbytes, category))
        if step.recompute_bytes:
            # the recomputation re-runs the forward: each layer's saved tensors exist from
            # the end of its re-run (StageCost.recompute_walk)
            r_span = mem_r_end - r_begin
            for t1, share in step.recompute_walk:
                deltas.append((device, r_begin + r_span * t1, step.recompute_bytes * share,
                               ACTIVATIONS))
        if step.loss_grad_bytes:
            # the loss's gradient goes as the stage's last layer's backward ends
            first_end = step.walk[0][1]
            deltas.append((device, mem_r_end + (mem_end - mem_r_end) * first_end,
                           -step.loss_grad_bytes, TEMPORARIES))
        if step.release or step.grads:
            # the backward proper walks back through the stage's layers: each layer's
            # weight gradients appear as its backward starts (a stage's first backward
            # allocates them), its saved activations go as it ends (StageCost.backward_walk)
            back = mem_r_end
            span = mem_end - back
            for t0, t1, grad_share, saved_share in step.walk:
                if step.grads and grad_share:
                    deltas.append((device, back + span * t0, step.grads * grad_share,
                                   GRADIENTS))
                if step.release and saved_share:
                    deltas.append((device, back + span * t1, -step.release * saved_share,
                                   ACTIVATIONS))

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
        """Turn every action into a shared :class:`Step` with its times, bytes and send.

        Steps depend on the micro-batch only through its cost (size, checkpointing), so
        equal steps are built once: ``programs[w]`` is a list of ``(microbatch, step)``.
        """
        plan, costs = self.plan, self.costs
        n = plan.n_stages
        workers = range(self.schedule.n_devices)
        # Event (stage * m + mb) * 2 + is_backward: the stage's input (or gradient) arrived;
        # then, per skip crossing stages, 2 * m more: its tensor (or gradient) arrived.
        self.steps = StepBuilder(self.profile, plan, costs, self.cluster, self.schedule,
                                 self.resource_of)
        self.n_events = self.steps.n_events
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
        # threads of one process that share it by measured pairs (Cluster.thread_pairs):
        # no interpreter, engine or stream law of their own, the pairs hold all three
        self.paired_processes = self.shared_processes if self.cluster.thread_pairs else []
        if self.paired_processes and self.profile.pair_slowdown(1.0) is None:
            raise ClusterError(
                f"{self.cluster.name}: thread_pairs needs a profile that measured its passes "
                f"in pairs (meta['pair_slowdown'], profile(..., pairs=True)); "
                f"{self.profile.source} has none")
        paired = {w for p in self.paired_processes for w in processes[p]}
        self.shared_processes = [p for p in self.shared_processes
                                 if p not in self.paired_processes]
        engines = defaultdict(list)
        for w in workers:
            if self.cluster.devices[w].engine and w not in paired:
                engines[self.cluster.devices[w].engine].append(w)
        self.shared_engines = [e for e, ws in engines.items() if len(ws) > 1]
        # each worker's rank on its engine: the autograd nodes its stages' forwards create
        # a micro-batch (see the module doc)
        self.engine_priority = [0.0] * len(self.cluster.devices)
        for s in range(n):
            layers = plan.stage_layers(s)
            self.engine_priority[self.placement[s]] += self.profile.autograd_nodes(
                layers.start, layers.stop)
        self.shared_hosts = ([h for h, ranks in self.steps.host_ranks.items() if len(ranks) > 1]
                             if self.cluster.host_contention or self.cluster.host_cores
                             or self.cluster.host_slowdowns else [])
        factor = 1 + plan.optimizer_state_factor
        self.static_bytes: dict[str, float] = defaultdict(float)
        for s in range(n):
            self.static_bytes[self.resource_of[self.placement[s]]] += (
                costs.stage_param_bytes(s) * factor)
        cache: dict[tuple, Step] = {}
        build = self.steps
        self.programs: list[list[tuple[int, Step]]] = []
        for w in workers:
            grads_seen: set[int] = set()
            program = []
            for s, kind, mb in self.schedule.order[w]:
                c = costs.cost(s, mb)
                # the stage's first action that forms weight gradients allocates them
                first_backward = kind in (BACKWARD, WEIGHT_GRAD) and s not in grads_seen
                if first_backward:
                    grads_seen.add(s)
                key = (s, kind, id(c), first_backward, (s, mb) in build.split)
                if self.durations and (s, kind, mb) in self.durations:
                    step = build.with_skips(build.step(w, s, mb, kind, c, first_backward,
                                                       self.durations[(s, kind, mb)]), w, mb)
                elif key in cache:
                    step = cache[key]
                else:
                    step = cache[key] = build.with_skips(
                        build.step(w, s, mb, kind, c, first_backward, None), w, mb)
                if w in paired:
                    step = self._paired(step, mb)
                program.append((mb, step))
            self.programs.append(program)

    def _paired(self, step: Step, mb: int) -> Step:
        """``step`` with its pass and its slowdowns beside each pass at micro-batch ``mb``'s
        size (:attr:`Step.pair_kind`, :attr:`Step.pair_row`; a split backward's I and W
        are backwards, I recomputing where checkpointed)."""
        checkpointed = self.plan.checkpointed(mb)
        forward = step.kind == FORWARD
        kind = ("F" if forward else "B") + ("c" if checkpointed and (
            forward or step.kind != WEIGHT_GRAD) else "")
        ratios = self.profile.pair_slowdown(self.plan.micro_batch_sizes[mb])
        assert ratios is not None  # checked in _compile
        return step._replace(pair_kind=kind,
                             pair_row=tuple(ratios[f"{kind}|{y}"] for y in PAIR_KINDS),
                             gap_pair_row=tuple(ratios[f"F|{y}"] for y in PAIR_KINDS))

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
