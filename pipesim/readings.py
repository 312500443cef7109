"""What was measured in place, span by span: the readings a :class:`pipesim.cluster.Cluster`
carries, and how one is read at a micro-batch size the measurement did not take.

Each reading names a span of layers ``[first, stop)`` (one stage) and a ``micro_batch``
size, and says what that stage's actions cost inside a running pipeline beyond its
profile, measured by :mod:`executor.in_place` in the run's own process layout:

    =================  ==========================================================
    SpanSlowdown       how much longer the stage runs beside its host's other ranks
    IdleCost           what a wait before an action adds to it (a curve in idle s)
    RunOnCost          a forward after a forward (a backward after a backward),
                       against after the other kind
    CheckpointExtra    what checkpointing adds to the stage's backward
    InPlaceCost        the stage's forward and backward measured whole, alone
    ExecutorGap        the executor's own seconds around each action
    =================  ==========================================================

Between measured sizes a reading is linear in log2(size), beyond them the nearest one's
(:func:`in_log2_size`); the Cluster's lookups (``Cluster.host_slowdown``,
``Cluster.idle_cost``, ...) choose the rows and read them so.  Plain frozen dataclasses,
so a Cluster's JSON holds them as dicts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipesim.errors import ClusterError


@dataclass(frozen=True)
class SpanSlowdown:
    """A span of layers ``[first, stop)`` at ``micro_batch`` samples runs ``slowdown`` (>= 1)
    times as long beside the other ranks of its host as alone, measured in place: every
    rank running its own stage's forward+backward at once, in the run's process layout,
    no message between them (:func:`executor.in_place.stage_contention`).  What the
    neighbours' compute costs *this* layout -- their memory traffic through the caches the
    ranks share -- beside what :attr:`Cluster.host_contention` holds: a generic workload's
    cost of a neighbour that computes and exchanges messages."""

    first: int
    stop: int
    micro_batch: int
    slowdown: float


def median_slowdowns(readings: Sequence[Sequence[SpanSlowdown]]) -> list[SpanSlowdown]:
    """Each span and size's median slowdown over repeated readings of one layout, in the
    first reading's order.  A reading taken in one of a shared host's slow spells reads
    every span of its layout high at once (this project's VM: MLP [4,4] 1.5-1.8 in one
    repeat of three, 1.1-1.3 in the others), so a median of three drops it where more
    rounds in one reading would not (``experiments/in_place_contention.py``).

    Raises :class:`pipesim.errors.ClusterError` where the readings do not cover the same
    spans and sizes (a median would mix layouts)."""
    if not readings:
        raise ClusterError("median_slowdowns needs at least one reading")
    keys = [(s.first, s.stop, s.micro_batch) for s in readings[0]]
    by_key: dict[tuple[int, int, int], list[float]] = {k: [] for k in keys}
    for number, reading in enumerate(readings):
        these = [(s.first, s.stop, s.micro_batch) for s in reading]
        if sorted(these) != sorted(keys):
            raise ClusterError(f"reading {number} covers spans and sizes {sorted(these)}, "
                               f"reading 0 {sorted(keys)}")
        for s in reading:
            by_key[(s.first, s.stop, s.micro_batch)].append(s.slowdown)
    return [SpanSlowdown(*k, float(np.median(by_key[k]))) for k in keys]


@dataclass(frozen=True)
class IdleCost:
    """What a forward or backward (``kind``, ``"F"`` or ``"B"``) of layers ``[first,
    stop)`` at ``micro_batch`` samples (checkpointed or not) costs more, ``seconds``, when
    its rank slept ``idle_s`` seconds before it, measured in place: the stage alone on its
    rank's cores, its message given at once and after ``idle_s``
    (:func:`executor.in_place.idle_costs`).  On a shared host what a rank touched fades
    from its caches while it waits: the action after the wait pays the misses::

        message there    |F|B|
        after a wait     |F|------ idle_s ------|B.......|     (B....: + seconds)
        kind "FB"        |F|------ idle_s ------|B|F.......|   (F....: + seconds)

    Kind ``"FB"`` is the forward right after a backward that waited ``idle_s``: a 1F1B
    rank's forward, which a wait before the backward slows as well on a host whose caches
    fade (what a forward touches is not all a backward touches), and not on one whose
    cost of a wait is its core's own (any action warms it again).
    """

    first: int
    stop: int
    micro_batch: int
    checkpointed: bool
    idle_s: float
    seconds: float
    kind: str = "B"
    #: the action's own seconds at this size, its message there at once and after the idle
    #: (records, but for ``hot_s`` beside ``profile_s``)
    hot_s: float = 0.0
    after_idle_s: float = 0.0
    #: the seconds the simulator gives the action alone from a profile taken in the same
    #: session (0: none): then ``Cluster.idle_cost`` reads the curve relative to the
    #: profile's own regime, ``profile_s - hot_s``
    profile_s: float = 0.0


#: what an :class:`IdleCost` times after a wait: a forward after a wait before it, a
#: backward after one, a forward right after a backward that waited
IDLE_KINDS = ("F", "B", "FB")


@dataclass(frozen=True)
class RunOnCost:
    """What a ``kind`` action (``"F"`` or ``"B"``) of layers ``[first, stop)`` at
    ``micro_batch`` samples (checkpointed or not) costs right after an action of the same
    kind and stage on its worker, against right after one of the other kind: ``scale =
    same_s / other_s``, measured in place (:func:`executor.in_place.run_on_costs`: the
    stage alone, a step in GPipe's order against its plain step, paired in rounds)::

        gpipe   |F0|F1|F2|..|B2|B1|B0|      F1, F2 after a forward; B1, B0 after a backward
        1f1b    |F0|B0|F1|B1|F2|B2|         F1, F2 after a backward; B0.. after a forward

    What an action finds in its core's caches depends on what ran just before it: a
    forward after a forward reads the weights that one just read, where a backward in
    between has streamed weight gradients and saved activations through the caches.  The
    profile (each layer's forward after its backward) and every in-place step time the
    other order, so a run of forwards or backwards costs ``scale`` times that."""

    first: int
    stop: int
    micro_batch: int
    checkpointed: bool
    kind: str
    scale: float
    #: the medians the scale comes from (seconds; records)
    same_s: float = 0.0
    other_s: float = 0.0


#: the kinds a :class:`RunOnCost` times: a forward after a forward, a backward after a backward
RUN_ON_KINDS = ("F", "B")


@dataclass(frozen=True)
class CheckpointExtra:
    """What checkpointing adds to the backward of layers ``[first, stop)`` at
    ``micro_batch`` samples, ``seconds``, measured in place: the stage's checkpointed
    backward (recomputing, torch.utils.checkpoint's hooks) less its plain one, each at the
    stage's steady pace on its rank's cores (:func:`executor.in_place.checkpoint_extras`)::

        plain          |======B======|
        checkpointed   |==R==|======B======|      seconds = checkpointed - plain

    The profile's own figure sums each layer checkpointed alone; on this project's VM it
    read MLP's last stage's checkpointed-to-plain ratio 7-19% under the in-place one
    (2026-11-26)."""

    first: int
    stop: int
    micro_batch: int
    seconds: float


@dataclass(frozen=True)
class InPlaceCost:
    """What the forward and the backward of layers ``[first, stop)`` cost at
    ``micro_batch`` samples (checkpointed or not), seconds, measured in place: the stage
    alone, its actions run through the executor's own code path and timed as a pipeline's
    recorder times them (:func:`executor.in_place.device_stage_costs` on a GPU)::

        profile    |=L0=| |=L1=| |=L2=|        each layer alone, summed (less the
        in place   |===L0 L1 L2===|            whole model's excess over that sum)

    What a profile adds up layer by layer, taken on the stage whole: its launches issued
    back to back, torch.utils.checkpoint entered once, the executor's recorder and the
    checkpoint's wrapper.  A lone cost, not a replay's: how the action shares a device,
    an interpreter or autograd's thread stays the model's.  On the H200 (2026-11-26) GPT's
    checkpointed actions cost 0.88x (forward) and 0.94x (backward) what the profile gives
    them (medians over stages and sizes; 0.55-1.04), MLP's 1.13x and 1.15x (up to 1.49x)."""

    first: int
    stop: int
    micro_batch: int
    checkpointed: bool
    fwd_s: float
    bwd_s: float


def in_place_costs_of(rows: Sequence[dict]) -> tuple[InPlaceCost, ...]:
    """:class:`InPlaceCost` rows from the dicts a measurement writes
    (:func:`executor.in_place.stage_costs`, :func:`executor.in_place.device_stage_costs`:
    ``first, stop, micro_batch, checkpointed, fwd_s, bwd_s``; other keys ignored)."""
    return tuple(InPlaceCost(int(r["first"]), int(r["stop"]), int(r["micro_batch"]),
                             bool(r["checkpointed"]), float(r["fwd_s"]), float(r["bwd_s"]))
                 for r in rows)


@dataclass(frozen=True)
class ExecutorGap:
    """The executor's own seconds around each action of layers ``[first, stop)`` at
    ``micro_batch`` samples (checkpointed or not), measured in place: the stage alone on
    its rank's cores running its actions through the executor's code path, its messages
    synthesised, its step's time less its actions' (:func:`executor.in_place.stage_costs`)::

        step    |..|=== F ===|..|====== B ======|..|      seconds = (the dots) / 2

    It is Python between a recorder's stop and the next start -- storing the stash,
    handing over the output, freeing the graph and the saved tensors, posting receives,
    wrapping the next forward -- and it grows with the stage and its size: on this
    project's VM 0.04 ms an action for the calibration pipeline's MLP, 0.03-0.09 for the
    grid's MLP stages, 0.03-0.31 for GPT's, 0.04-0.56 for U-Net's (2026-11-26).  No send is
    in it: the calibrated gaps have the transport's part."""

    first: int
    stop: int
    micro_batch: int
    checkpointed: bool
    seconds: float


def read_curve(points: tuple[tuple[float, float], ...], x: float) -> float:
    """``points`` ``((x, y), ...)`` (x increasing) read at ``x``: linear between them, the
    nearest one's ``y`` beyond them.  The simulator reads a worker's wake-up and idle
    curves so at every action: each curve's columns are made once."""
    xs, ys = _columns(points)
    return float(np.interp(x, xs, ys))


@functools.lru_cache(maxsize=1024)
def _columns(points: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The x and y columns of a curve's points, as arrays (cached: curves are tuples)."""
    return (np.array([p[0] for p in points], dtype=float),
            np.array([p[1] for p in points], dtype=float))


def span_at(rows: Sequence, first: int, stop: int, size: float,
            value: Callable[[Any], float]) -> float | None:
    """``value`` of the ``rows`` (with ``first``, ``stop``, ``micro_batch``) measured for
    layers ``[first, stop)``, read at ``size`` (:func:`in_log2_size`); None where none are."""
    points = sorted((x.micro_batch, value(x)) for x in rows if x.first == first and x.stop == stop)
    return in_log2_size(points, size) if points else None


def in_log2_size(points: list[tuple[int, float]], size: float) -> float:
    """``points`` (micro-batch size, value), sorted by size, read at ``size``: linear in
    log2(size) between them, the nearest one's value beyond them."""
    return float(np.interp(math.log2(size), [math.log2(b) for b, _ in points],
                           [v for _, v in points]))
