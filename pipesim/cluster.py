"""The Cluster: devices, the links between them, and the executor's per-action overheads.

Devices here are the pipeline's workers (one action list each).  Several workers may
share one physical device (``physical``): one GPU standing in for many.  Workers on one
physical device share its compute (in turn, or concurrently: ``device_sharing``) and its
memory, and hand tensors over without a copy.

Overheads are what the profile does not see: the executor's time inside each compute
action (hooks, Python; counted as busy), between actions (``action_gap_s``: posting
sends, waking up; idle) and around each transfer.  ``executor.calibrate`` measures them;
the presets below are starting points, not measurements.  What was measured in place
for each stage (its contention, idle costs, ...) rides on the Cluster as the readings of
:mod:`pipesim.readings`; the lookups here read them at an action's span and size.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipesim.errors import ClusterError
from pipesim.readings import (
    IDLE_KINDS,
    RUN_ON_KINDS,
    CheckpointExtra,
    ExecutorGap,
    IdleCost,
    InPlaceCost,
    RunOnCost,
    SpanSlowdown,
    in_log2_size,
    read_curve,
    span_at,
)


@dataclass(frozen=True)
class Link:
    """A one-way link: a transfer of ``b`` bytes takes ``latency_s + b / bandwidth_Bps``."""

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + (nbytes / self.bandwidth_Bps if nbytes else 0.0)


FREE = Link(0.0, math.inf)

#: device types whose backward autograd runs on a thread of its own, one per device
ACCELERATORS = frozenset({"cuda", "xpu", "mps", "hpu", "mtia", "privateuseone"})


@dataclass(frozen=True)
class Device:
    """A worker: its name, the physical device it runs on, that device's memory (bytes)."""

    name: str
    physical: str = ""
    memory_bytes: float = math.inf
    #: machine the device is on; workers of one host slow each other down (see
    #: ``Cluster.host_contention``); "" shares nothing
    host: str = ""
    #: Python process the worker is a thread of: the threads of one process hold its
    #: interpreter one at a time, for the share of each action measured in the profile
    #: (:attr:`pipesim.costs.StageCost.interpreter_fwd_share`); "" shares nothing
    process: str = ""

    @property
    def resource(self) -> str:
        """The compute resource this worker uses (its physical device)."""
        return self.physical or self.name

    @property
    def engine(self) -> str:
        """The thread that issues this worker's backward, where threads share one: autograd
        runs the backward of an accelerator's tensors on one thread per device and process
        (a CPU's on the calling thread), so the threads of one process driving one GPU
        issue their backwards one at a time; "" where the worker's own thread does."""
        return f"{self.process}/{self.physical}" if self.process and self.on_accelerator else ""

    @property
    def on_accelerator(self) -> bool:
        """Whether the worker runs on an accelerator (``physical`` such as ``cuda:0``),
        whose caching allocator reserves more than its tensors hold
        (:mod:`pipesim.allocator`)."""
        return self.physical.split(":")[0] in ACCELERATORS


@dataclass
class Cluster:
    """Workers, links and overheads (seconds, bytes, bytes/second)."""

    devices: list[Device]
    link: Link = FREE
    #: overrides of ``link`` for ordered pairs (src worker, dst worker)
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    compute_overhead_s: float = 0.0
    transfer_overhead_s: float = 0.0
    #: executor time between actions on a worker (posting sends, bookkeeping): an action
    #: whose input is there when its worker reaches it starts ``action_gap_s`` after;
    #: idle time
    action_gap_s: float = 0.0
    #: an action whose worker reached it first and blocked on its input starts
    #: ``wakeup_gap_s`` after the input arrives: the blocked thread must be woken and
    #: scheduled, on a loaded host several times the gap between actions::
    #:
    #:     input there      prev |==|.gap.|== F ==|
    #:     input late       prev |==|  ...blocked... ^arrival .wakeup.|== F ==|
    #:
    #: None: ``action_gap_s`` for both (cluster files from before 2026-11-24)
    wakeup_gap_s: float | None = None
    #: how much longer a wake-up takes the longer the worker waited: ``((idle seconds,
    #: extra seconds), ...)`` from ``(0, 0)``, read linearly at the wait since the worker's
    #: previous action ended (the last point's beyond), added to ``wakeup_s``.  An idle
    #: core sleeps deeper: on this project's VM a receiver blocked 1 ms woke in 0.13-0.16
    #: ms, after 10-30 ms in 0.30-0.36 (``executor.calibrate.measure_wakeups``, a
    #: micro-benchmark; ``wakeup_gap_s`` comes from a pipeline whose waits are short).
    #: Empty: ``wakeup_s`` after any wait
    wakeup_curve: tuple[tuple[float, float], ...] = ()
    #: processor sharing between workers of one host (CPU processes competing for memory
    #: bandwidth, caches and the communication threads): while k compute actions run on a
    #: host, each progresses at 1 / (1 + host_contention * (k - 1)) of its profiled speed
    host_contention: float = 0.0
    #: what a message costs the compute action its receiver is running when it arrives:
    #: the receiving rank's communication thread (gloo's) reads it on the cores that
    #: action computes on (a pinned rank's one core), so the action ends ``landing_s +
    #: landing_byte_s * bytes`` later for each message that lands in it; one its worker
    #: waits for lands in no action and costs nothing here (the wake-up holds that)::
    #:
    #:     sender     |== F(0,m) ==|send        lands mid-action: + landing
    #:     receiver      |== F(1,m-1) ==+|== F(1,m) ==|
    #:
    #: Measured on the calibration workload's steps against a neighbour's message timed to
    #: land mid-step or between steps (:func:`executor.calibrate.measure_landing`).  0:
    #: messages cost their receiver nothing while it computes
    landing_s: float = 0.0
    landing_byte_s: float = 0.0
    #: the host contention measured in place for one model's stages (see
    #: :class:`SpanSlowdown`): where an action's span has one, the action runs at the
    #: larger of that slowdown and ``host_contention``'s law while another rank of its
    #: host computes (the law's share of a reading taken with every other rank busy);
    #: spans without one have the law alone.  On this project's 2-core VM a stage beside a
    #: neighbour streaming memory ran 1.13-1.20x, beside one spinning on registers
    #: 0.98-1.06x (``experiments/neighbour_standin.py --continuous 4``): the layouts differ
    #: by their memory traffic (MLP [4,4]'s first stage 1.13-1.23, GPT's stages
    #: 1.00-1.08), which the calibration's small workload does not have
    host_slowdowns: tuple[SpanSlowdown, ...] = ()
    #: what an action costs more after its worker idled (:class:`IdleCost`, measured in
    #: place per span, kind, size, checkpoint mode and idle): a forward or backward that
    #: starts ``g`` seconds after its worker's previous action ended pays the measured
    #: seconds at ``g`` (linear between the idles measured, 0 at none, the longest's beyond
    #: it), less the profile's excess over the action at once where that was measured
    #: (:meth:`idle_cost`).  Empty: no such cost
    idle_costs: tuple[IdleCost, ...] = ()
    #: what a forward after a forward, or a backward after a backward, of the same stage on
    #: one worker costs against the other order, measured in place (:class:`RunOnCost`):
    #: such an action costs its seconds times the scale read at its size (linear in
    #: log2(size) between those measured).  Empty: the order costs nothing
    run_on_costs: tuple[RunOnCost, ...] = ()
    #: what checkpointing adds to a stage's backward, measured in place
    #: (:class:`CheckpointExtra`): a checkpointed backward with no idle cost to read (the
    #: last stage's, which never waits; any stage's where none were measured) costs its
    #: plain profile seconds plus this, in place of the profile's recomputation and
    #: checkpoint costs; one with an idle cost is read in place already.  Empty: the
    #: profile's
    checkpoint_extras: tuple[CheckpointExtra, ...] = ()
    #: the executor's own seconds around each action of a stage, measured in place
    #: (:class:`ExecutorGap`), and the same figure for the pipeline ``action_gap_s`` and
    #: ``wakeup_gap_s`` were calibrated on, whose gaps hold it already
    #: (``executor_gap_base_s``): an action of a span with rows whose input was there
    #: pauses ``action_gap_s`` plus the difference (:meth:`executor_gap`; a worker that
    #: blocked on its input did that work before it blocked: its ``wakeup_gap_s`` stays).
    #: The calibrated gaps come from a small MLP; a stage freeing a larger graph or
    #: touching more memory spends longer between its actions.  Empty: the calibrated
    #: gaps for every action
    executor_gaps: tuple[ExecutorGap, ...] = ()
    executor_gap_base_s: float = 0.0
    #: what a stage's forward and backward cost, measured in place (:class:`InPlaceCost`):
    #: an action of a span with rows (its checkpoint mode's) costs that alone, in place of
    #: its profile seconds, its overhead and, checkpointed, its recomputation and the
    #: checkpoint's costs (the recomputation keeps its profiled share); not where the
    #: action has an idle cost to read, nor for a split backward.  Empty: the profile's.
    #: (Plans whose balances were measured and plans whose were not are priced by two
    #: different rulers: to compare balances, as the tuner does, measure them all or none;
    #: :func:`pipesim.tune.tune` warns when its candidates mix the two.)
    in_place_costs: tuple[InPlaceCost, ...] = ()
    #: compute actions a host runs at once (its cores over the threads a worker uses);
    #: beyond that they are time-sliced (see :func:`pipesim.contention.host_law`); 0: no
    #: limit
    host_cores: int = 0
    #: how workers sharing one physical device use it: ``"serial"`` (their actions take
    #: turns: CPU threads of one process, a GPU driven from one stream) or
    #: ``"concurrent"`` (each worker's stream runs its kernels alongside the others', as
    #: pipesim's threads do on one GPU; law in :mod:`pipesim.contention`)
    device_sharing: str = "serial"
    #: measured aggregate speedup of k concurrent streams on one device, k = 1, 2, ...
    #: (first entry 1); empty: read off the profile's size scaling
    device_speedup: tuple[float, ...] = ()
    #: the sender keeps every tensor it sends to another device (activations, gradients,
    #: skips) alive until the iteration ends: torch.distributed over gloo reports a send
    #: complete only when it is waited for, which pipesim's process transport does at the
    #: end of the step
    sender_keeps_sends: bool = False
    #: a worker posts the receive of an action's input (or gradient) as it moves to the
    #: action before it, so the receive buffer exists from then, not from the bytes'
    #: arrival: pipesim's gloo transport (executor.transport.DistTransport.prefetch)
    receives_ahead: bool = False
    #: with ``receives_ahead``: a worker posts them once the action before has its own
    #: inputs (as its compute starts), where that action is a forward or a whole backward;
    #: after a split backward's parts, as it reaches them.  The executor's order since
    #: 2026-11-27 (``StageRunner._inputs_in``: a receive posted while a message streams in
    #: on a gloo connection stalls that message); False: as it reaches the action before
    #: (``prefetch_after_inputs=False``, and runs recorded before)::
    #:
    #:     worker  |wait F1 in|== F1 ==|wait F2 in|== F2 ==|
    #:     False   ^ F2's buffer held from here
    #:     True               ^ from here
    receives_after_inputs: bool = False
    #: with ``receives_ahead``: a worker posts every receive of its step as the step
    #: starts, so each receive buffer exists from then (the executor's default since
    #: 2026-11-30, ``StageRunner(receives_at_start=True)``: over gloo a message sent before
    #: its receive is posted waits for the sender's I/O thread, behind the sender's compute)
    receives_at_start: bool = False
    #: a send occupies its sender until its bytes are written: gloo over TCP writes a
    #: message whose receive is posted from the calling thread (``dist.isend`` returns
    #: after 1 MiB in 0.5 ms, 4 MiB in 1.7 ms on this project's VM), so the worker starts
    #: its next action only then; False: sends stream in the background (a copy stream)
    blocking_sends: bool = False
    #: an accelerator's worker issues an action's kernels and goes on: its host is free
    #: once it has issued them (a forward's host seconds, a backward's when autograd's
    #: thread for the device has), not when the device has run them, so the executor's
    #: gap to its next action runs from then and hides behind the device's work where the
    #: host is ahead; an action whose issue is its time (launch-bound) still pays it whole::
    #:
    #:     host     |issue F|gap|issue F|gap|          device-bound: gaps hidden
    #:     device   |====== F ======|====== F ======|
    #:
    #:     host     |== issue F ==|gap|== issue F ==|  launch-bound: gaps paid
    #:     device    |===== F =====|   |===== F =====|
    #:
    #: False: the host is busy to the action's end (a CPU, where host and device are one)
    issue_ahead: bool = False
    #: workers that are threads of one process slow each other as measured pass beside
    #: pass (the profile's ``meta["pair_slowdown"]``, ``profile(..., pairs=True)``): while
    #: the other thread runs pass Y, an action of pass X progresses at ``1 / ratio("X|Y")``
    #: of its own speed (X, Y: ``F``, ``B``, ``Fc``, ``Bc``), in place of the interpreter's
    #: turns, autograd's device thread and the device's concurrency law, which the pairs
    #: were measured with (:class:`pipesim.contention.PairSharing`)::
    #:
    #:     alone         F |=====|        Bc |==========|
    #:     together      F |======|       Bc |..........====|==========|   "Bc|F" >> "F|Bc"
    #:
    #: Opt-in (a profile without the pairs is refused): on seven CPU threads runs
    #: (2026-11-26 evening) the pairs pooled better at the median (11.4% against 15.7%)
    #: and worse at the worst plan (63.9% against 31.6%), each run alike (median 19.2%
    #: against 18.8%); a GPU grid has not measured them yet.
    #: False: the interpreter's and the engine's turns, by their measured shares
    thread_pairs: bool = False
    #: workers that are threads of one process hold its interpreter for the executor's own
    #: seconds between their actions (``action_gap_s``, the wake-up, a stage's measured
    #: gap): Python -- handing the output over, posting receives, the recorder -- in turn
    #: with the other threads' share of their actions, which it slows::
    #:
    #:     worker 0   |== F ==|gap|== F ==|          the gap holds the interpreter
    #:     worker 1       |=== B ==..==|             B's share waits during it
    #:
    #: Where the threads share by measured pairs (``thread_pairs``), a gap is taken as a
    #: forward: slowed, and slowing the pass beside it, by the forward's pairs.
    #: False: the gaps are the worker's own time, holding nothing
    gaps_hold_interpreter: bool = False
    #: a checkpointed backward's recomputation has autograd's thread for the device to
    #: itself while it issues it: torch.utils.checkpoint re-runs the forward inside the
    #: node that first reads a saved tensor, so that thread serves no other node (another
    #: stage's backward, or its recomputation) until the re-run forward has issued its
    #: kernels and returned -- the kernels then run on beside what the thread does next;
    #: Python's turns with the other threads' forwards slow the issue all the while::
    #:
    #:     worker 0   B(0, m)   |R0 issue|...........====|    R1 waits for R0's issue,
    #:     worker 1   B(1, m')   .........|R1 issue|=======|  B0's backward proper for R1's
    #:
    #: In the H100 grid of 2026-11-23 no two stages' recomputations were issued at once:
    #: 0 of 9120 host intervals overlap (their kernels 2.5% of their seconds), where the
    #: turns below put 16% of them beside another (gpt bf16 GPipe [5,5] m=2 ``always``:
    #: stage 0's recomputation 23.0-25.5 ms, stage 1's 27.6-29.9 ms, their backwards
    #: issued at 22.4 and 22.5 ms).  False: a recomputation takes turns on autograd's
    #: thread as a backward's nodes do, beside the other stage's
    recompute_holds_engine: bool = True
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.devices:
            raise ClusterError("a cluster needs at least one device")
        for what, v in (("compute_overhead_s", self.compute_overhead_s),
                        ("transfer_overhead_s", self.transfer_overhead_s),
                        ("action_gap_s", self.action_gap_s),
                        ("wakeup_gap_s", self.wakeup_gap_s or 0.0),
                        ("host_contention", self.host_contention),
                        ("landing_s", self.landing_s),
                        ("landing_byte_s", self.landing_byte_s),
                        ("host_cores", self.host_cores),
                        ("link latency_s", self.link.latency_s)):
            if v < 0 or math.isnan(v):
                raise ClusterError(f"{what} must be non-negative, got {v}")
        if self.device_sharing not in ("serial", "concurrent"):
            raise ClusterError(f"device_sharing must be 'serial' or 'concurrent', got "
                               f"{self.device_sharing!r}")
        self.device_speedup = tuple(float(v) for v in self.device_speedup)
        if any(not 1.0 <= v <= k + 1 for k, v in enumerate(self.device_speedup)):
            raise ClusterError(f"device_speedup[k-1] must lie in [1, k], got {list(self.device_speedup)}")
        self.host_slowdowns = tuple(x if isinstance(x, SpanSlowdown) else SpanSlowdown(**x)
                                    for x in self.host_slowdowns)
        for x in self.host_slowdowns:
            if not x.slowdown >= 1.0 or math.isinf(x.slowdown):
                raise ClusterError(f"host slowdown of layers [{x.first}, {x.stop}) at "
                                   f"{x.micro_batch} samples must be >= 1, got {x.slowdown}")
        self.idle_costs = tuple(x if isinstance(x, IdleCost) else IdleCost(**x)
                                for x in self.idle_costs)
        for cost in self.idle_costs:
            if (not cost.idle_s > 0 or not math.isfinite(cost.seconds)
                    or cost.kind not in IDLE_KINDS):
                raise ClusterError(f"idle cost of layers [{cost.first}, {cost.stop}) at "
                                   f"{cost.micro_batch} samples needs idle_s > 0, finite "
                                   f"seconds and kind 'F', 'B' or 'FB', got {cost.idle_s}, "
                                   f"{cost.seconds} and {cost.kind!r}")
        self.run_on_costs = tuple(x if isinstance(x, RunOnCost) else RunOnCost(**x)
                                  for x in self.run_on_costs)
        for run_on in self.run_on_costs:
            if (not (math.isfinite(run_on.scale) and run_on.scale > 0)
                    or run_on.kind not in RUN_ON_KINDS or run_on.micro_batch < 1):
                raise ClusterError(f"run-on cost of layers [{run_on.first}, {run_on.stop}) at "
                                   f"{run_on.micro_batch} samples needs a micro-batch >= 1, a "
                                   f"finite scale > 0 and kind 'F' or 'B', got "
                                   f"{run_on.scale} and {run_on.kind!r}")
        self.checkpoint_extras = tuple(x if isinstance(x, CheckpointExtra) else CheckpointExtra(**x)
                                       for x in self.checkpoint_extras)
        for extra in self.checkpoint_extras:
            if not math.isfinite(extra.seconds) or extra.micro_batch < 1:
                raise ClusterError(f"checkpoint extra of layers [{extra.first}, {extra.stop}) "
                                   f"needs a micro-batch >= 1 and finite seconds, got "
                                   f"{extra.micro_batch} and {extra.seconds}")
        self.wakeup_curve = tuple((float(i), float(v)) for i, v in self.wakeup_curve)
        idles = [i for i, _ in self.wakeup_curve]
        if self.wakeup_curve and (idles != sorted(set(idles)) or idles[0] != 0.0 or any(
                not (math.isfinite(v) and v >= 0) for _, v in self.wakeup_curve)):
            raise ClusterError("wakeup_curve must run from idle 0 through increasing idles "
                               "with finite seconds >= 0, got "
                               f"{[list(p) for p in self.wakeup_curve]}")
        self.in_place_costs = tuple(x if isinstance(x, InPlaceCost) else InPlaceCost(**x)
                                    for x in self.in_place_costs)
        for cost_row in self.in_place_costs:
            times = (cost_row.fwd_s, cost_row.bwd_s)
            if not all(math.isfinite(t) and t > 0 for t in times) or cost_row.micro_batch < 1:
                raise ClusterError(f"in-place cost of layers [{cost_row.first}, {cost_row.stop}) "
                                   f"needs a micro-batch >= 1 and seconds > 0, got "
                                   f"{cost_row.micro_batch}, {cost_row.fwd_s} and {cost_row.bwd_s}")
        self.executor_gaps = tuple(x if isinstance(x, ExecutorGap) else ExecutorGap(**x)
                                   for x in self.executor_gaps)
        for row in self.executor_gaps:
            if not math.isfinite(row.seconds) or row.seconds < 0 or row.micro_batch < 1:
                raise ClusterError(f"executor gap of layers [{row.first}, {row.stop}) needs a "
                                   f"micro-batch >= 1 and seconds >= 0, got "
                                   f"{row.micro_batch} and {row.seconds}")
        if self.executor_gaps and not self.executor_gap_base_s > 0:
            raise ClusterError("executor_gaps need executor_gap_base_s, the same figure for "
                               "the calibration pipeline (> 0), got "
                               f"{self.executor_gap_base_s}: the calibrated gaps hold that much "
                               "of it already")
        if not self.link.bandwidth_Bps > 0:
            raise ClusterError(f"link bandwidth must be positive, got {self.link.bandwidth_Bps}")

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def wakeup_s(self) -> float:
        """Seconds from a blocked worker's input arriving to its action starting:
        ``wakeup_gap_s``, or ``action_gap_s`` where the cluster has none."""
        return self.action_gap_s if self.wakeup_gap_s is None else self.wakeup_gap_s

    def wakeup_after(self, idle: float) -> float:
        """Seconds from a blocked worker's input arriving to its action starting, after it
        waited ``idle`` seconds since its previous action: ``wakeup_s`` and what
        ``wakeup_curve`` adds at that wait."""
        if not self.wakeup_curve or idle <= 0:
            return self.wakeup_s
        return self.wakeup_s + read_curve(self.wakeup_curve, idle)

    def link_between(self, src: int, dst: int) -> Link:
        """The link from worker ``src`` to worker ``dst``; free on one physical device."""
        if self.devices[src].resource == self.devices[dst].resource:
            return FREE
        return self.links.get((src, dst), self.link)

    def host_slowdown(self, first: int, stop: int, size: float) -> float | None:
        """The measured slowdown (:class:`SpanSlowdown`) of layers ``[first, stop)`` at
        ``size`` samples: linear in log2(size) between measured sizes, the nearest one's
        beyond them; None where that span was not measured."""
        return span_at(self.host_slowdowns, first, stop, size, lambda x: x.slowdown)

    def checkpoint_extra(self, first: int, stop: int, size: float) -> float | None:
        """Seconds checkpointing adds to the backward of layers ``[first, stop)`` at
        ``size`` samples (:class:`CheckpointExtra`, linear in log2(size) between measured
        sizes, the nearest one's beyond them; a reading below 0 is noise and reads 0);
        None where that span was not measured."""
        return span_at(self.checkpoint_extras, first, stop, size,
                        lambda x: max(x.seconds, 0.0))

    def run_on_scale(self, first: int, stop: int, size: float, checkpointed: bool,
                     kind: str) -> float:
        """How many times its seconds a ``kind`` action of layers ``[first, stop)`` at
        ``size`` samples costs right after one of the same kind and stage
        (:class:`RunOnCost`, linear in log2(size) between measured sizes, the nearest
        one's beyond them); 1 where that span, mode and kind were not measured."""
        rows = [x for x in self.run_on_costs
                if x.checkpointed == checkpointed and x.kind == kind]
        scale = span_at(rows, first, stop, size, lambda x: x.scale)
        return 1.0 if scale is None else scale

    def in_place_cost(self, first: int, stop: int, size: float, checkpointed: bool
                      ) -> tuple[float, float] | None:
        """Seconds of the forward and the backward of layers ``[first, stop)`` at ``size``
        samples in that checkpoint mode, measured in place (:class:`InPlaceCost`, linear in
        log2(size) between measured sizes, the nearest one's beyond them); None where that
        span and mode were not measured."""
        rows = [x for x in self.in_place_costs if x.checkpointed == checkpointed]
        fwd = span_at(rows, first, stop, size, lambda x: x.fwd_s)
        if fwd is None:
            return None
        bwd = span_at(rows, first, stop, size, lambda x: x.bwd_s)
        assert bwd is not None  # (the same rows)
        return fwd, bwd

    def executor_gap(self, first: int, stop: int, size: float, checkpointed: bool) -> float:
        """Seconds an action of layers ``[first, stop)`` at ``size`` samples pauses beyond
        the calibrated gap (below 0: less): its span's :class:`ExecutorGap` (that
        checkpoint mode's rows, else the other mode's; linear in log2(size) between
        measured sizes, the nearest one's beyond them) less ``executor_gap_base_s``; 0
        where the span was not measured."""
        rows = [x for x in self.executor_gaps if x.checkpointed == checkpointed]
        seconds = (span_at(rows, first, stop, size, lambda x: x.seconds)
                   if rows else None)
        if seconds is None:
            seconds = span_at(self.executor_gaps, first, stop, size, lambda x: x.seconds)
        return 0.0 if seconds is None else seconds - self.executor_gap_base_s

    def idle_cost(self, first: int, stop: int, size: float, checkpointed: bool,
                  kind: str = "B") -> tuple[tuple[float, float], ...]:
        """What a ``kind`` action of layers ``[first, stop)`` at ``size`` samples costs more
        than its profile after its worker idled, from the :class:`IdleCost` rows:
        ``((idle seconds, extra seconds), ...)`` by idle, from idle 0 on, each point linear
        in log2(size) between the measured sizes (the nearest one's beyond them); ``()``
        where that span was not measured.  A wait never makes an action cheaper than at
        once: measured differences below 0 are the noise and read as 0.  Where the rows
        carry ``profile_s``, every point is less the profile's excess over the action at
        once, ``profile_s - hot_s`` (the profile's own regime, measured)::

            extra(idle) = seconds(idle) - (profile_s - hot_s)      seconds(0) = 0
        """
        rows = [x for x in self.idle_costs
                if (x.first, x.stop, x.checkpointed, x.kind) == (first, stop, checkpointed, kind)]
        if not rows:
            return ()
        idles = sorted({x.idle_s for x in rows})
        offset = 0.0
        if all(x.profile_s > 0 for x in rows):
            offset = in_log2_size(sorted((x.micro_batch, x.profile_s - x.hot_s) for x in rows
                                          if x.idle_s == idles[0]), size)
        curve = [(0.0, -offset)]
        for idle in idles:
            points = sorted((x.micro_batch, max(x.seconds, 0.0)) for x in rows if x.idle_s == idle)
            curve.append((idle, in_log2_size(points, size) - offset))
        return tuple(curve)

    # ---------------------------------------------------------------- presets
    @classmethod
    def free(cls, n: int) -> Cluster:
        """``n`` devices, instantaneous links, no overheads: the analytic model."""
        return cls([Device(f"dev{i}") for i in range(n)], name="free")

    @classmethod
    def cpu_processes(cls, n: int, memory_bytes: float = math.inf) -> Cluster:
        """``n`` CPU processes talking over gloo on loopback (rough defaults)."""
        return cls([Device(f"cpu{i}", memory_bytes=memory_bytes, host="localhost")
                    for i in range(n)],
                   link=Link(60e-6, 2e9), compute_overhead_s=30e-6, transfer_overhead_s=20e-6,
                   sender_keeps_sends=True, receives_ahead=True, receives_after_inputs=True,
                   receives_at_start=True, blocking_sends=True, name="cpu_processes")

    @classmethod
    def cpu_threads(cls, n: int, cores: int = 0, memory_bytes: float = math.inf) -> Cluster:
        """``n`` stage threads of one process on the CPU (the in-process executor): each
        computes on a core of its own -- of ``cores`` (0: as many as threads), taken in
        turn beyond them -- and all hold one interpreter, for the shares a profile measured
        with ``interpreter=True``; no copies (rough overhead)."""
        cores = cores or n
        return cls([Device(f"t{i}", physical=f"core{i % cores}", memory_bytes=memory_bytes,
                           process="main") for i in range(n)],
                   compute_overhead_s=30e-6, name="cpu_threads")

    @classmethod
    def nvlink_gpus(cls, n: int, memory_bytes: float = 80 * 2**30) -> Cluster:
        """``n`` GPUs on NVLink (H100-class: ~10 us, ~300 GB/s a direction, rough)."""
        return cls([Device(f"cuda:{i}", memory_bytes=memory_bytes) for i in range(n)],
                   link=Link(10e-6, 300e9), compute_overhead_s=20e-6, name="nvlink_gpus")

    @classmethod
    def pcie_gpus(cls, n: int, memory_bytes: float = 80 * 2**30) -> Cluster:
        """``n`` GPUs on PCIe 4/5 (~15 us, ~25 GB/s a direction, rough)."""
        return cls([Device(f"cuda:{i}", memory_bytes=memory_bytes) for i in range(n)],
                   link=Link(15e-6, 25e9), compute_overhead_s=20e-6, name="pcie_gpus")

    @classmethod
    def shared_gpu(cls, n: int, memory_bytes: float = 80 * 2**30) -> Cluster:
        """``n`` workers on one GPU ``cuda:0``: shared compute and memory, no copies."""
        return cls([Device(f"w{i}", physical="cuda:0", memory_bytes=memory_bytes)
                    for i in range(n)], compute_overhead_s=20e-6, device_sharing="concurrent",
                   name="shared_gpu")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = asdict(self)
        d["links"] = [{"src": s, "dst": t, **asdict(link)} for (s, t), link in self.links.items()]
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> Cluster:
        try:
            devices = [Device(**dev) for dev in d["devices"]]
            links = {(int(x["src"]), int(x["dst"])): Link(x["latency_s"], x["bandwidth_Bps"])
                     for x in d.get("links", [])}
            return cls(devices=devices, link=Link(**d.get("link", {})), links=links,
                       compute_overhead_s=float(d.get("compute_overhead_s", 0.0)),
                       transfer_overhead_s=float(d.get("transfer_overhead_s", 0.0)),
                       action_gap_s=float(d.get("action_gap_s", 0.0)),
                       wakeup_gap_s=(None if d.get("wakeup_gap_s") is None
                                     else float(d["wakeup_gap_s"])),
                       wakeup_curve=tuple(tuple(p) for p in d.get("wakeup_curve", ())),
                       host_contention=float(d.get("host_contention", 0.0)),
                       landing_s=float(d.get("landing_s", 0.0)),
                       landing_byte_s=float(d.get("landing_byte_s", 0.0)),
                       host_slowdowns=tuple(SpanSlowdown(**x)
                                            for x in d.get("host_slowdowns", ())),
                       idle_costs=tuple(IdleCost(**x) for x in d.get("idle_costs", ())),
                       checkpoint_extras=tuple(CheckpointExtra(**x)
                                               for x in d.get("checkpoint_extras", ())),
                       run_on_costs=tuple(RunOnCost(**x) for x in d.get("run_on_costs", ())),
                       executor_gaps=tuple(ExecutorGap(**x)
                                           for x in d.get("executor_gaps", ())),
                       executor_gap_base_s=float(d.get("executor_gap_base_s", 0.0)),
                       in_place_costs=tuple(InPlaceCost(**x)
                                            for x in d.get("in_place_costs", ())),
                       host_cores=int(d.get("host_cores", 0)),
                       device_sharing=str(d.get("device_sharing", "serial")),
                       device_speedup=tuple(d.get("device_speedup", ())),
                       sender_keeps_sends=bool(d.get("sender_keeps_sends", False)),
                       receives_ahead=bool(d.get("receives_ahead", False)),
                       receives_after_inputs=bool(d.get("receives_after_inputs", False)),
                       receives_at_start=bool(d.get("receives_at_start", False)),
                       blocking_sends=bool(d.get("blocking_sends", False)),
                       issue_ahead=bool(d.get("issue_ahead", False)),
                       thread_pairs=bool(d.get("thread_pairs", False)),
                       gaps_hold_interpreter=bool(d.get("gaps_hold_interpreter", False)),
                       recompute_holds_engine=bool(d.get("recompute_holds_engine", True)),
                       name=d.get("name", "cluster"))
        except ClusterError as exc:
            raise ClusterError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ClusterError(f"{source}: malformed cluster description ({exc!r})") from None

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"{path}: no such cluster file") from None
        except json.JSONDecodeError as exc:
            raise ClusterError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))
