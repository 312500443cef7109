"""What each action of a schedule does, compiled once for the discrete-event engine.

:class:`StepBuilder` turns an action -- ``(worker, stage, kind, micro-batch)`` -- into a
:class:`Step`: its seconds (profile costs, the cluster's overheads, the recomputation),
the events it waits for, what it sends over which link, and every memory change it makes
(per category, when it starts, as it runs, when it ends).  The engine
(:mod:`pipesim.simulator`) decides *when* each step runs; this module holds *what* it costs
and allocates -- the memory rules live here, in one place:

* a forward keeps its stash (the stage's output alone when checkpointed) to its backward;
* a backward walks back layer by layer: weight gradients appear as each layer starts (a
  stage's first backward), saved tensors go as it ends; a checkpointed one first
  rebuilds its activations layer by layer (``StageCost.recompute_walk``);
* a transfer between devices gives the receiver a buffer from arrival (or from when it
  posted the receive) to the end of the action that uses it; a sender that keeps its
  sends (gloo) holds them to the step's end;
* skips go straight from the stashing to the popping stage (see :meth:`StepBuilder.with_skips`).
"""

from __future__ import annotations

from typing import NamedTuple

from pipesim.cluster import FREE, Cluster
from pipesim.costs import WHOLE, PlanCosts, StageCost
from pipesim.errors import ScheduleError
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.schedule import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Schedule,
)


class Step(NamedTuple):
    """One action compiled for the SimPy loop (all lookups done once per simulation)."""

    stage: int
    kind: str
    waits: tuple[int, ...]  # events it needs: ``base + 2 * mb`` for each base
    seconds: float  # total duration before jitter (overhead and recomputation included)
    recompute_s: float
    alloc_start: Parts  # bytes allocated when it starts, per category
    alloc_end: Parts  # bytes allocated (negative: freed) when it ends, per category
    send: Send | None
    extra_sends: tuple[Send, ...] = ()  # skip tensors or gradients it sends
    release: float = 0.0  # bytes freed progressively while it runs (see walk)
    grads: float = 0.0  # weight-gradient bytes allocated progressively (a first backward)
    walk: tuple[tuple[float, float, float, float], ...] = ((0.0, 1.0, 1.0, 1.0),)  # see StageCost
    recv_bytes: float = 0.0  # its input (gradient) from another device: the receive buffer
    interpreter_s: float = 0.0  # of ``seconds``, those its thread holds the interpreter
    interpreter_slowdown: float = 1.0  # those seconds' slowdown while it has company
    recompute_bytes: float = 0.0  # activations it recomputes, appearing along recompute_walk
    recompute_walk: tuple[tuple[float, float], ...] = ((0.0, 1.0),)  # see StageCost
    engine_s: float = 0.0  # of ``seconds``, those autograd's device thread spends issuing it
    #: of ``engine_s``, the recomputation's (torch.utils.checkpoint re-runs the forward from
    #: autograd's thread), and of those the seconds it holds the process's interpreter
    engine_recompute_s: float = 0.0
    engine_interpreter_s: float = 0.0
    #: of ``engine_s`` less the recomputation's, those it also holds the process's
    #: interpreter (a checkpointed backward's unpack hooks are Python)
    engine_hooks_s: float = 0.0
    #: how many times slower it runs, while another rank of its host computes, than the
    #: host law alone makes it: where the cluster measured its span in place and the
    #: reading exceeds the law's (:meth:`StepBuilder.host_slowdown`; 1: the host law
    #: alone, or a measured duration)
    host_slowdown: float = 1.0
    #: what it costs more (less: negative) than ``seconds`` after its worker idled:
    #: ``((idle seconds, extra seconds), ...)`` from idle 0 on, read linearly at the idle
    #: before it (the last point's beyond); empty: nothing (:meth:`StepBuilder.idle_curve`;
    #: a forward or a full backward)
    idle_curve: tuple[tuple[float, float], ...] = ()
    #: a forward's extra seconds (as ``idle_curve``'s, the same baseline) right after a
    #: backward on its worker that waited, read at that backward's wait: the in-place
    #: ``"FB"`` curve (:class:`pipesim.readings.IdleCost`); empty: none measured
    after_wait_curve: tuple[tuple[float, float], ...] = ()
    #: how many times ``seconds`` it costs right after an action of its own kind and stage
    #: on its worker (a forward after a forward, a backward after a backward), measured in
    #: place (:meth:`pipesim.cluster.Cluster.run_on_scale`); 1: the order costs nothing
    run_on_scale: float = 1.0
    #: seconds it pauses beyond the cluster's calibrated gap before it starts, where its
    #: input was there when its worker reached it (below 0: less): its stage's executor
    #: work between actions, measured in place (:meth:`pipesim.cluster.Cluster.executor_gap`)
    gap_s: float = 0.0
    #: of ``seconds``, those its worker's host spends issuing it before it can go on (a
    #: forward's host seconds; a backward's, autograd's thread issuing it, its own turn
    #: on that thread aside): where the cluster lets an accelerator's host run ahead
    #: (:attr:`pipesim.cluster.Cluster.issue_ahead`); 0: busy to the action's end
    issue_s: float = 0.0
    #: its pass among the measured pairs (``F``, ``B``, ``Fc``, ``Bc``: a checkpointed
    #: micro-batch's passes apart) and its slowdowns beside each of them at its size, where
    #: its worker shares its process by pairs (:attr:`pipesim.cluster.Cluster.thread_pairs`)
    pair_kind: str = ""
    pair_row: tuple[float, ...] = ()
    #: a loss stage's full backward: the loss's gradient (the size of the logits), made
    #: at its start and freed as its last layer's backward ends (the walk's first layer),
    #: not held through the layers before it
    loss_grad_bytes: float = 0.0
    #: the slowdowns of its worker's gap before it (the executor's Python, taken as a
    #: forward's) beside each pass, where the gaps hold the interpreter
    #: (:attr:`pipesim.cluster.Cluster.gaps_hold_interpreter`) and the worker shares its
    #: process by pairs
    gap_pair_row: tuple[float, ...] = ()


#: what memory is for (the categories of Trace.memory_by_category): parameters and optimizer
#: state, weight gradients, activations kept for backward (and recomputed ones), buffers
#: received from another device, and temporaries (transients, gradients in flight)
MEMORY_CATEGORIES = ("parameters", "gradients", "activations", "received", "temporaries")
#: their codes, as memory changes carry them (an index into MEMORY_CATEGORIES)
PARAMETERS, GRADIENTS, ACTIVATIONS, RECEIVED, TEMPORARIES = range(len(MEMORY_CATEGORIES))
Parts = tuple[tuple[int, float], ...]


def parts(*pairs: tuple[int, float]) -> Parts:
    """``(category code, bytes)`` pairs summed per category, zeros dropped."""
    out: dict[int, float] = {}
    for category, nbytes in pairs:
        out[category] = out.get(category, 0.0) + nbytes
    return tuple((c, v) for c, v in out.items() if v)


class Send(NamedTuple):
    """A transfer an action makes when it ends (the engine times it on its link)."""

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
    #: the worker that receives it (``src`` for a hand-over between its own stages)
    receiver: int = -1


class StepBuilder:
    """Builds the :class:`Step` of each action of ``schedule`` (see the module doc).

    ``resource_of[w]`` is worker ``w``'s physical device.  Skips crossing stages get
    events after the ``2 * n * m`` stage inputs and gradients: per skip, ``2 * m`` more
    (its tensor and its gradient, per micro-batch).
    """

    def __init__(self, profile: Profile, plan: Plan, costs: PlanCosts, cluster: Cluster,
                 schedule: Schedule, resource_of: list[str]):
        self.profile, self.plan, self.costs, self.cluster = profile, plan, costs, cluster
        self.resource_of, self.placement = resource_of, schedule.placement
        n = plan.n_stages
        stage_of = {layer: s for s in range(n) for layer in plan.stage_layers(s)}
        routes = profile.skip_routes()
        #: skips crossing stages: (name, stashing stage, popping stage)
        self.skips = [(name, stage_of[a], stage_of[b]) for name, a, b in routes
                      if stage_of[a] != stage_of[b]]
        self.skip_layer = {name: a for name, a, _ in routes}
        #: skips whose two ends are in one stage (name, stage), and that stage's first layer
        #: is not the stashed tensor's maker (then it is the stage input, kept anyway)
        self.inner_skips = [(name, stage_of[a]) for name, a, b in routes
                            if stage_of[a] == stage_of[b] and a != plan.stage_layers(stage_of[a]).start]
        if self.skips and schedule.splits_backward:
            raise ScheduleError(f"schedule {schedule.name!r} splits the backward, and skip "
                                f"connections cross stages here ({', '.join(n for n, *_ in self.skips)})"
                                ": not modelled yet; use a schedule with a full backward")
        #: (stage, micro-batch) whose backward is split into I and W
        self.split = {(a.stage, a.microbatch) for a in schedule.actions() if a.kind == INPUT_GRAD}
        #: each host's ranks (physical devices) among the schedule's workers: the ranks
        #: that share it under the host law
        self.host_ranks: dict[str, set[str]] = {}
        for w in range(schedule.n_devices):
            if cluster.devices[w].host:
                self.host_ranks.setdefault(cluster.devices[w].host, set()).add(resource_of[w])
        #: events: each stage input and gradient per micro-batch, then each skip's
        self.n_events = 2 * n * plan.n_microbatches + 2 * plan.n_microbatches * len(self.skips)

    def step(self, w: int, s: int, mb: int, kind: str, c: StageCost, first_backward: bool,
              measured: float | None) -> Step:
        n, m = self.plan.n_stages, self.plan.n_microbatches
        # One size per stage boundary, the sender's output, for the activation and its
        # gradient alike: what one side allocates the other frees, byte for byte.
        boundary = self.costs.cost(s - 1, mb).output_bytes if s > 0 else 0.0
        overhead = self.cluster.compute_overhead_s
        device = self.resource_of[w]
        # (a measured duration has its contention in it already)
        slow = 1.0 if measured is not None else self.host_slowdown(w, s, mb)
        # (a pause, not a duration: a measured duration leaves it to be simulated)
        layers = self.plan.stage_layers(s)
        gap = self.cluster.executor_gap(layers.start, layers.stop,
                                        self.plan.micro_batch_sizes[mb], self.plan.checkpointed(mb))
        # what a wait before it costs (a forward's or a full backward's, not a replay's)
        idle = (self.idle_curve(s, mb, kind) if kind in (FORWARD, BACKWARD) and measured is None
                else ())
        # (the stage's actions measured in place, where they were and nothing else reads
        # the action in place already: an idle cost, a split backward)
        placed = (self.cluster.in_place_cost(layers.start, layers.stop,
                                             self.plan.micro_batch_sizes[mb],
                                             self.plan.checkpointed(mb))
                  if self.cluster.in_place_costs and measured is None
                  and (s, mb) not in self.split and not idle
                  else None)
        # (a run of forwards or of backwards: a forward or a full backward, not a replay's)
        run_on = (self.cluster.run_on_scale(layers.start, layers.stop,
                                            self.plan.micro_batch_sizes[mb],
                                            self.plan.checkpointed(mb), kind)
                  if self.cluster.run_on_costs and kind in (FORWARD, BACKWARD)
                  and measured is None else 1.0)
        if kind == FORWARD:
            plain = (s, mb) in self.split  # its backward is split: no checkpoint hooks
            seconds = (c.fwd_s - (c.ckpt_fwd_extra_s if plain else 0.0) + overhead
                       if measured is None else measured)
            if placed is not None:
                seconds = placed[0]
            send = self._send(w, s, s + 1, "SEND_F", c.output_bytes) if s < n - 1 else None
            # transients are held while the forward runs; what it keeps stays at its end
            t = c.fwd_transient_bytes
            recv = boundary if s > 0 and self._crosses(s - 1, device) else 0.0
            return Step(s, kind, (s * m * 2,) if s > 0 else (), seconds, 0.0,
                         parts((TEMPORARIES, t)),
                         parts((ACTIVATIONS, c.keep_bytes), (TEMPORARIES, -t)), send,
                         recv_bytes=recv,
                         interpreter_s=0.0 if measured is not None else seconds * c.interpreter_fwd_share,
                         interpreter_slowdown=c.interpreter_fwd_slowdown, host_slowdown=slow,
                         idle_curve=idle,
                         after_wait_curve=(self.idle_curve(s, mb, "FB") if idle else ()),
                         run_on_scale=run_on, gap_s=gap,
                         issue_s=0.0 if measured is not None else seconds * c.host_fwd_share)
        in_grad = boundary
        loss_grad = c.output_bytes if s == n - 1 else 0.0
        # transients of the backward: a stage's first backward allocates its gradients,
        # which stay, and its new weight gradients are them (not temporaries beside them);
        # later ones form weight gradients in temporaries before adding them
        grads = c.param_bytes if first_backward else 0.0
        # (so its transient is the one beside them, StageCost.bwd_first_transient_bytes)
        transient = c.bwd_first_transient_bytes if first_backward else c.bwd_transient_bytes
        # Freed at the end of the backward (of W when split): stash, recomputed
        # activations, loss gradient, the received activation (another device's) and the
        # received gradient.  The input gradient lives on: handed to stage s-1 on this
        # device, or freed when its send ends.  The stash and the recomputed activations go
        # as the backward walks back -- but not an output sent to another device whose
        # sender keeps its sends to the step's end.
        release = c.released_bytes
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
        # the worker, Step.recompute_bytes) -- but for as much as the loss's saved tensors
        # it frees first: that part takes their place at the start (one instant, one net
        # change: frees first at an instant would otherwise take them before F kept them)
        in_place = min(c.recompute_bytes, c.freed_first_bytes)
        gradient_start = [(ACTIVATIONS, in_place - c.freed_first_bytes),
                          (TEMPORARIES, in_grad + loss_grad)]
        if kind == WEIGHT_GRAD:
            # W: weight gradients from the output gradients I kept, then everything goes
            seconds = c.bwd_weight_s + overhead if measured is None else measured
            issuing = seconds * c.host_bwd_share  # autograd's engine issuing it
            return Step(s, kind, (), seconds, 0.0,
                         parts((TEMPORARIES, transient)),
                         parts(*freed, (TEMPORARIES, -c.w_pending_bytes)), None,
                         release=release, grads=grads, walk=c.backward_walk or WHOLE,
                         interpreter_s=0.0 if measured is not None else seconds * c.interpreter_bwd_share,
                         interpreter_slowdown=c.interpreter_bwd_slowdown,
                         engine_s=issuing, host_slowdown=slow, gap_s=gap,
                         issue_s=0.0 if measured is not None else issuing)
        recompute = c.recompute_s
        if kind == INPUT_GRAD:
            # I: the input gradient (after recomputing, when checkpointed); the stash, the
            # received tensors and the output gradients for W stay until W
            seconds = c.bwd_input_s + recompute + overhead
            alloc_start = parts(*gradient_start, (TEMPORARIES, transient))
            alloc_end = parts((TEMPORARIES, c.w_pending_bytes - transient))
            release = 0.0
        else:
            seconds = c.bwd_s + recompute + overhead
            alloc_start = parts(*gradient_start, (TEMPORARIES, transient))
            # (the loss's gradient goes as the last layer's backward ends: the walk)
            alloc_end = parts(*freed, (TEMPORARIES, loss_grad))
        if kind == BACKWARD and placed is not None:
            # its cost in place, the recomputation its profiled share of it
            recompute *= placed[1] / seconds if seconds > 0 else 1.0
            seconds = placed[1]
        elif kind == BACKWARD and measured is None and recompute and not idle:
            # checkpointing's cost measured in place, where the action has no idle curve
            # (which would read it in place already): the plain backward and that extra,
            # the recomputation its profiled share of the extra
            extra = self.cluster.checkpoint_extra(layers.start, layers.stop,
                                                  self.plan.micro_batch_sizes[mb])
            if extra is not None:
                profiled = recompute + c.ckpt_bwd_extra_s
                recompute *= extra / profiled if profiled > 0 else 1.0
                seconds = c.bwd_s - c.ckpt_bwd_extra_s + extra + overhead
        # (a recomputation is a forward: Python issuing, under the interpreter)
        held = (seconds * c.interpreter_ckpt_bwd_share if c.interpreter_ckpt_bwd_share is not None
                else recompute * c.interpreter_fwd_share
                + (seconds - recompute) * c.interpreter_bwd_share)
        # what autograd's engine issues: the backward, and the recomputation that
        # torch.utils.checkpoint runs from it (a split backward's I re-runs the forward on
        # the worker's own thread first)
        engine = (seconds - recompute) * c.host_bwd_share
        engine_recompute = engine_held = hooks = 0.0
        if kind == BACKWARD:
            # the backward proper's Python on autograd's thread (the checkpoint's hooks)
            hooks = engine * c.engine_interpreter_share
            engine_recompute = recompute * c.host_fwd_share
            engine += engine_recompute
            # the recomputation is a forward in Python, issued from autograd's thread: it
            # holds the interpreter as a (checkpointed) forward does
            engine_held = recompute * c.interpreter_fwd_share
        if measured is not None:
            factor = measured / seconds if seconds else 1.0
            engine, engine_recompute = engine * factor, engine_recompute * factor
            seconds, recompute, held, engine_held = measured, min(recompute, measured), 0.0, 0.0
            hooks = 0.0
        recv = c.output_bytes if s < n - 1 and self._crosses(s + 1, device) else 0.0
        return Step(s, kind, waits, seconds, recompute, alloc_start, alloc_end, send,
                     release=release, recv_bytes=recv,
                     grads=grads if kind == BACKWARD else 0.0, walk=c.backward_walk or WHOLE,
                     interpreter_s=held, interpreter_slowdown=c.interpreter_bwd_slowdown,
                     recompute_bytes=c.recompute_bytes - in_place,
                     recompute_walk=c.recompute_walk or ((0.0, 1.0),), engine_s=engine,
                     engine_recompute_s=engine_recompute, engine_interpreter_s=engine_held,
                     engine_hooks_s=hooks,
                     host_slowdown=slow, idle_curve=idle, run_on_scale=run_on, gap_s=gap,
                     issue_s=0.0 if measured is not None else engine,
                     loss_grad_bytes=loss_grad if kind == BACKWARD else 0.0)

    def idle_curve(self, stage: int, mb: int, kind: str) -> tuple[tuple[float, float], ...]:
        """What ``stage``'s ``kind`` action at micro-batch ``mb`` costs more (less: below 0)
        than its profile after its worker idled (:attr:`Step.idle_curve`,
        :meth:`pipesim.cluster.Cluster.idle_cost`)."""
        if not self.cluster.idle_costs:
            return ()
        layers = self.plan.stage_layers(stage)
        return self.cluster.idle_cost(layers.start, layers.stop, self.plan.micro_batch_sizes[mb],
                                      self.plan.checkpointed(mb), kind)

    def host_slowdown(self, w: int, stage: int, mb: int) -> float:
        """How many times slower worker ``w``'s ``stage`` action at micro-batch ``mb``'s
        size runs beside the other ranks of its host than the host law alone makes it
        (:attr:`Step.host_slowdown`): where its span's slowdown was measured in place, the
        part of it the law does not charge with every other rank of the host busy (as it
        was measured), so that the action pays the larger of the two; 1 elsewhere.  Each
        is a floor of what a neighbour that computes and exchanges messages costs the
        layout -- the law's generic workload has not its memory traffic, the in-place
        reading not its messages (:attr:`pipesim.cluster.Cluster.host_slowdowns`).  With
        fewer ranks busy than measured the action pays the law's share of the moment
        times this, a little under its reading."""
        layers = self.plan.stage_layers(stage)
        measured = self.cluster.host_slowdown(layers.start, layers.stop,
                                              self.plan.micro_batch_sizes[mb])
        if measured is None:
            return 1.0
        ranks = len(self.host_ranks.get(self.cluster.devices[w].host, ()))
        return max(1.0, measured / (1.0 + self.cluster.host_contention * max(ranks - 1, 0)))

    def _crosses(self, stage: int, device: str) -> bool:
        """Whether ``stage`` runs on another physical device than ``device``."""
        return self.resource_of[self.placement[stage]] != device

    def with_skips(self, step: Step, w: int, mb: int) -> Step:
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
                # to another device whose transport keeps its sends (see pipesim.simulator._Run._send)
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
                             alloc_end=parts(*alloc_end), release=release, recv_bytes=recv)

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
              event: int | None = None) -> Send:
        m = self.plan.n_microbatches
        dst = self.placement[dst_stage]
        if event is None:
            event = dst_stage * m * 2 + (kind == "SEND_B")
        src_dev, dst_dev = self.resource_of[src], self.resource_of[dst]
        # memory moves unless both stages are on one physical device (a hand-over; see
        # pipesim.simulator._Run._send for when the receiver's buffer exists)
        holds = dst_dev != src_dev
        dst_memory = dst_dev if holds else ""
        link = self.cluster.link_between(src, dst) if src != dst else FREE
        over = self.cluster.transfer_overhead_s
        if src == dst or (link is FREE and not over):
            return Send(kind, event, None, 0.0, 0.0, nbytes, src_dev, dst_memory, "",
                        receiver=dst)
        occupancy = over + link.seconds(nbytes) - link.latency_s
        return Send(kind, event, (src, dst), occupancy, link.latency_s, nbytes, src_dev,
                    dst_memory, f"dev{src}->dev{dst}", receiver=dst)
