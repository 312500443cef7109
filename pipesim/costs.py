"""Per-stage, per-micro-batch costs of a Plan, read from a Profile once and cached.

The simulator and the tuner both ask "how long is F(s, m), how many bytes does it keep";
this module is the one place that answers, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pipesim.balance import stage_firsts
from pipesim.cluster import Cluster
from pipesim.contention import speedup_from_scaling
from pipesim.plan import Plan
from pipesim.profile import LayerCost, Profile
from pipesim.readings import IdleCost

#: a backward in one part (no per-layer walk known): gradients at its start, frees at its end
WHOLE = ((0.0, 1.0, 1.0, 1.0),)


@dataclass(frozen=True)
class StageCost:
    """Costs of one stage on one micro-batch (seconds, bytes).

    ``keep_bytes`` stays alive from the end of F to the end of B (the stage input is not
    included: it is the received buffer, accounted where it arrives).  Checkpointed
    micro-batches keep only their output; their backward re-runs the forward
    (``recompute_s``) and holds ``recompute_bytes`` while it runs.
    """

    fwd_s: float
    bwd_s: float
    recompute_s: float
    input_bytes: float
    output_bytes: float
    keep_bytes: float
    recompute_bytes: float
    param_bytes: float
    #: held only while F runs (above what it has kept so far) / while B runs (beyond the
    #: input gradient): temporaries, weight gradients being formed; 0 if not profiled
    fwd_transient_bytes: float = 0.0
    bwd_transient_bytes: float = 0.0
    #: ``bwd_transient_bytes`` of a stage's first backward, whose weight gradients stay
    #: (allocated layer by layer along ``backward_walk``, beside it): such that the flat
    #: transient and the walk's gradients and frees peak where the layers' rises with the
    #: gradients walked so far do (:attr:`pipesim.profile.LayerCost.bwd_first_rise_bytes`)
    bwd_first_transient_bytes: float = 0.0
    #: freed as the backward starts, before anything else: on a checkpointed stage that
    #: ends in the loss, what the loss saved (the loss runs outside the checkpoint, so its
    #: backward comes first and frees them before the recomputation)
    freed_first_bytes: float = 0.0
    #: a split backward (seconds): the input gradient ``I`` (a checkpointed micro-batch
    #: recomputes first, ``recompute_s``: the executor re-runs the forward itself, not
    #: through torch.utils.checkpoint, so neither F nor I pays the checkpoint's hooks) and
    #: the weight gradients ``W``; and the output gradients ``I`` keeps alive for ``W``
    bwd_input_s: float = 0.0
    bwd_weight_s: float = 0.0
    w_pending_bytes: float = 0.0
    #: what torch.utils.checkpoint adds to ``fwd_s`` (0 unless checkpointed): a forward
    #: whose backward is split runs without it
    ckpt_fwd_extra_s: float = 0.0
    #: what torch.utils.checkpoint adds to ``bwd_s`` beside the recomputation (0 unless
    #: checkpointed; below 0 where it saves): ``bwd_s - ckpt_bwd_extra_s`` is the plain
    #: backward
    ckpt_bwd_extra_s: float = 0.0
    #: the backward's walk back through the stage's layers, last layer first: per layer
    #: ``(start, end, parameter share, saved share)`` -- when its backward starts and ends
    #: as fractions of the backward proper (by profiled seconds), its share of the stage's
    #: parameter bytes (its weight gradients appear as it starts) and of the stage's saved
    #: bytes (freed as it ends).  Empty: one part, everything at once.
    backward_walk: tuple[tuple[float, float, float, float], ...] = ()
    #: the recomputation's walk forward through the layers (a checkpointed backward): per
    #: layer ``(end, saved share)`` -- when its re-run forward ends, as a fraction of the
    #: recomputation (by profiled forward seconds), and its share of the saved bytes, which
    #: exist from then.  Empty: all at the recomputation's start.
    recompute_walk: tuple[tuple[float, float], ...] = ()
    #: share of a forward's / a backward's seconds its thread holds the interpreter
    #: (:meth:`pipesim.profile.Profile.interpreter_share`; 0 where not measured): what
    #: stages that are threads of one process cannot do at the same time
    interpreter_fwd_share: float = 0.0
    interpreter_bwd_share: float = 0.0
    #: a checkpointed micro-batch's backward (recomputation included) measured as one
    #: pass: the share of all its seconds; None: the recomputation at the forward's share,
    #: the rest at the backward's
    interpreter_ckpt_bwd_share: float | None = None
    #: how much slower than its turn the forward's / the backward's interpreter share runs
    #: while another thread wants the interpreter (>= 1; the checkpointed passes' own where
    #: the micro-batch is checkpointed): :meth:`pipesim.profile.Profile.interpreter_slowdown`
    interpreter_fwd_slowdown: float = 1.0
    interpreter_bwd_slowdown: float = 1.0
    #: share of the forward's / the backward's seconds the host spends issuing them
    #: (:attr:`pipesim.profile.LayerCost.host_fwd_share`); a GPU's backward is issued by
    #: autograd's one engine thread for that device, which the threads of a process share
    host_fwd_share: float = 1.0
    host_bwd_share: float = 1.0
    #: share of the backward's seconds on autograd's device thread that also holds the
    #: interpreter (torch.utils.checkpoint's unpack hooks, where checkpointed):
    #: :meth:`pipesim.profile.Profile.engine_interpreter_share`
    engine_interpreter_share: float = 0.0

    @property
    def released_bytes(self) -> float:
        """Bytes the backward frees as it walks back through the stage's layers: its
        stash and recomputed activations, less what the loss saved, freed first."""
        return self.recompute_bytes + self.keep_bytes - self.freed_first_bytes


class PlanCosts:
    """``cost(stage, microbatch)`` for a Plan on a Profile, at the real micro-batch sizes."""

    def __init__(self, profile: Profile, plan: Plan, *, extrapolate: bool = False):
        plan.check_layers(profile.n_layers)
        self.profile, self.plan = profile, plan
        self.extrapolate = extrapolate
        sizes = plan.micro_batch_sizes
        cache: dict[tuple[int, int, bool], StageCost] = {}
        self._table: list[list[StageCost]] = []
        for s in range(plan.n_stages):
            layers = plan.stage_layers(s)
            row = []
            for m, size in enumerate(sizes):
                ckpt = plan.checkpointed(m)
                key = (s, size, ckpt)
                if key not in cache:
                    span = profile.span_cost(layers.start, layers.stop, size, extrapolate=extrapolate)
                    walk = _backward_walk(profile, layers.start, layers.stop, size, extrapolate)
                    gil = profile.interpreter_share(size) or (0.0, 0.0)
                    # torch.utils.checkpoint runs Python hooks on every saved tensor: a
                    # checkpointed pass holds the interpreter for its own measured share
                    gil_ckpt = profile.checkpointed_interpreter_share(size) if ckpt else None
                    slow = profile.interpreter_slowdown(size)
                    # The input is the previous stage's output, accounted on arrival.
                    first = profile.at(layers.start, size, extrapolate=extrapolate)
                    internal = span.stash_bytes - first["saved_input_bytes"]
                    loss_stage = profile.ends_in_loss(layers.stop)
                    # a recomputation makes every saved tensor anew, the output too where
                    # a layer saves it (the output itself is kept)
                    recomputed = (internal - span.output_bytes + span.output_saved_bytes
                                  if ckpt else 0.0)
                    cache[key] = StageCost(
                        # a checkpointed forward pays the checkpoint's own cost (hooks,
                        # random state) and so does its backward, beside recomputing
                        fwd_s=span.fwd_s + (span.ckpt_fwd_extra_s if ckpt else 0.0),
                        bwd_s=span.bwd_s + (span.ckpt_bwd_extra_s if ckpt else 0.0),
                        recompute_s=span.fwd_s if ckpt else 0.0,
                        input_bytes=span.input_bytes,
                        output_bytes=span.output_bytes,
                        keep_bytes=span.output_bytes if ckpt else internal,
                        recompute_bytes=recomputed,
                        param_bytes=span.param_bytes,
                        # a checkpointed forward saves nothing as it goes: only a layer's
                        # temporaries.  A recomputation runs inside the backward: its peak
                        # is the forward's own (activations so far + one layer's
                        # temporaries), the backward proper's is all of them + its own
                        bwd_transient_bytes=(
                            _checkpointed_transient(span, recomputed) if ckpt else span.bwd_transient_bytes),
                        fwd_transient_bytes=span.fwd_temp_bytes if ckpt else span.fwd_transient_bytes,
                        backward_walk=walk,
                        recompute_walk=_recompute_walk(profile, layers.start, layers.stop, size,
                                                       extrapolate) if ckpt else (),
                        interpreter_fwd_share=gil_ckpt[0] if gil_ckpt else gil[0],
                        interpreter_bwd_share=gil[1],
                        interpreter_ckpt_bwd_share=gil_ckpt[1] if gil_ckpt else None,
                        interpreter_fwd_slowdown=slow["Fc" if ckpt else "F"],
                        interpreter_bwd_slowdown=slow["Bc" if ckpt else "B"],
                        host_fwd_share=span.host_fwd_share,
                        host_bwd_share=span.host_bwd_share,
                        engine_interpreter_share=profile.engine_interpreter_share(size)[
                            1 if ckpt else 0],
                        freed_first_bytes=span.output_bytes if ckpt and loss_stage else 0.0,
                        bwd_input_s=span.bwd_input_s,
                        ckpt_fwd_extra_s=span.ckpt_fwd_extra_s if ckpt else 0.0,
                        ckpt_bwd_extra_s=span.ckpt_bwd_extra_s if ckpt else 0.0,
                        bwd_weight_s=span.bwd_weight_s,
                        w_pending_bytes=span.w_pending_bytes,
                    )
                    cost = cache[key]
                    cache[key] = dataclasses.replace(cost, bwd_first_transient_bytes=(
                        _first_transient(span, cost, ckpt,
                                         span.output_bytes if loss_stage and not ckpt else 0.0)))
                row.append(cache[key])
            self._table.append(row)

    def cost(self, stage: int, microbatch: int) -> StageCost:
        return self._table[stage][microbatch]

    def stage_param_bytes(self, stage: int) -> float:
        return self._table[stage][0].param_bytes

    def device_speedup(self, streams: int) -> list[float]:
        """Aggregate speedup of ``streams`` workers' kernels run together on one device.

        Measured where the profile holds it (:meth:`pipesim.profile.Profile.stream_speedup`
        at the plan's first micro-batch size; beyond the streams measured, the last value).
        Otherwise read off the profile's size scaling for the whole model (see
        :func:`pipesim.contention.speedup_from_scaling`): ``k`` streams of micro-batches of
        ``b`` samples do the work of one stream of ``k * b``.  Beyond the largest profiled
        size the time grows in proportion to the size (a saturated device).  The scaling
        law sees only the device's idle share; the measured one also the threads' shared
        host issue, which on launch-bound layers is what limits the gain (an H100 grid:
        1.0-1.4 measured where scaling says 2).
        """
        profile = self.profile
        measured = profile.stream_speedup(self.plan.micro_batch_sizes[0])
        if measured is not None:
            return [measured[min(k, len(measured) - 1)] for k in range(streams)]
        largest = profile.micro_batch_sizes[-1]
        whole = (0, profile.n_layers)

        def time_at(size: float) -> float:
            at = min(size, largest)
            span = profile.span_cost(*whole, at, extrapolate=self.extrapolate)
            return (span.fwd_s + span.bwd_s) * size / at

        return speedup_from_scaling(time_at, self.plan.micro_batch_sizes[0], streams)


def _checkpointed_transient(span: LayerCost, recomputed: float) -> float:
    """Bytes a checkpointed backward holds beside its recomputed activations (added at its
    start, as :attr:`StageCost.bwd_transient_bytes`), so that its peak is the larger of
    the recomputation's and the backward proper's::

        recomputation      start + (activations so far + one layer's forward temporaries)
                           at most start + span.recompute_rise_bytes
        backward proper    start + recomputed + span.bwd_transient_body_bytes

    (the loss, outside the checkpoint, runs its backward first: the body's transients).
    The recomputation's temporaries are gone once it ends, so they are not held through
    the backward proper: the larger one layer's temporaries hold only while the forward's
    activations are not all there yet."""
    return max(span.bwd_transient_body_bytes, span.recompute_rise_bytes - recomputed, 0.0)


def _first_transient(span: LayerCost, cost: StageCost, ckpt: bool, loss_grad: float) -> float:
    """:attr:`StageCost.bwd_first_transient_bytes` of ``cost``: a stage's first backward
    holds its weight gradients as they are made, layer by layer, and they stay.  The
    simulator adds them along the backward's walk as each layer starts, and frees the
    stash and the recomputed activations (:attr:`StageCost.released_bytes`) as each ends,
    beside a flat transient (and a plain loss stage's ``loss_grad`` through the first
    layer walked); so the transient is the true peak less the most the walk holds above
    its start::

        true peak       max_j(rise_j + grads of the layers walked before j)
                        (checkpointed: the recomputation's peak, or the recomputed
                        activations + that after recomputing)
        simulated       transient + max_i(grads walked through i - bytes freed before i)

    Where the largest layer's gradients were taken off instead, a loss layer's peak, which
    holds no weight gradient (its loss's gradients come first), came out a block's
    gradients short (GPT's loss stage 2% under)."""
    if ckpt:
        peak = max(span.bwd_first_body_bytes, span.recompute_rise_bytes - cost.recompute_bytes)
    else:
        peak = span.bwd_first_rise_bytes
    grads = freed = held = 0.0
    walk = cost.backward_walk or WHOLE
    for i, (_, _, grad_share, saved_share) in enumerate(walk):
        grads += cost.param_bytes * grad_share
        held = max(held, grads - freed + (loss_grad if i == 0 else 0.0))
        freed += cost.released_bytes * saved_share
    return max(peak - held, 0.0)


def _backward_walk(profile: Profile, first: int, stop: int, size: float,
                   extrapolate: bool) -> tuple[tuple[float, float, float, float], ...]:
    """:attr:`StageCost.backward_walk` of layers ``first .. stop-1`` at ``size`` samples."""
    cols = profile.columns_at(size, extrapolate=extrapolate)
    bwd, params, saved = (cols[c][first:stop][::-1] for c in ("bwd_s", "param_bytes", "saved_bytes"))
    total_s, total_p, total_b = float(bwd.sum()), float(params.sum()), float(saved.sum())
    n = stop - first
    walk, t = [], 0.0
    for i in range(n):
        share = float(bwd[i]) / total_s if total_s > 0 else 1.0 / n
        walk.append((t, min(t + share, 1.0),
                     float(params[i]) / total_p if total_p > 0 else 1.0 / n,
                     float(saved[i]) / total_b if total_b > 0 else 1.0 / n))
        t += share
    return tuple(walk)


def _recompute_walk(profile: Profile, first: int, stop: int, size: float,
                    extrapolate: bool) -> tuple[tuple[float, float], ...]:
    """:attr:`StageCost.recompute_walk` of layers ``first .. stop-1`` at ``size`` samples."""
    cols = profile.columns_at(size, extrapolate=extrapolate)
    fwd, saved = cols["fwd_s"][first:stop], cols["saved_bytes"][first:stop]
    total_s, total_b, n = float(fwd.sum()), float(saved.sum()), stop - first
    walk, t = [], 0.0
    for i in range(n):
        t += float(fwd[i]) / total_s if total_s > 0 else 1.0 / n
        walk.append((min(t, 1.0), float(saved[i]) / total_b if total_b > 0 else 1.0 / n))
    return tuple(walk)


def profile_seconds(profile: Profile, cluster: Cluster, balance: list[int], size: int,
                    checkpointed: bool) -> list[tuple[float, float]]:
    """``(forward, backward)`` seconds the simulator gives each stage's actions alone at
    ``size`` samples (profile, isolation correction, the cluster's in-action overhead)."""
    plan = Plan(balance, 1, size, checkpoint="always" if checkpointed else "never")
    costs = PlanCosts(profile, plan)
    overhead = cluster.compute_overhead_s
    return [(c.fwd_s + overhead, c.bwd_s + c.recompute_s + overhead)
            for c in (costs.cost(s, 0) for s in range(plan.n_stages))]


def with_profile_seconds(rows: Sequence[IdleCost], profile: Profile, cluster: Cluster,
                         balance: Sequence[int]) -> list[IdleCost]:
    """``rows`` of :func:`executor.in_place.idle_costs` for ``balance`` with ``profile_s``:
    the seconds the simulator gives each action alone from ``profile``
    (:func:`profile_seconds`), a profile taken in the same session as the rows, so that
    the simulator reads them against the profile's own regime
    (:meth:`pipesim.cluster.Cluster.idle_cost`)."""
    firsts = stage_firsts(balance)
    alone = {(b, ckpt): profile_seconds(profile, cluster, list(balance), b, ckpt)
             for b in {r.micro_batch for r in rows} for ckpt in (False, True)}
    return [dataclasses.replace(r, profile_s=alone[(r.micro_batch, r.checkpointed)][
        firsts.index(r.first)][1 if r.kind == "B" else 0]) for r in rows]
