"""The auto-tuner: choose balance, chunks, checkpoint mode and schedule under a memory budget.

For every chunks count whose micro-batch size the profile covers, every checkpoint mode
and schedule:

1. **balance exactly**: min-max partition (dynamic programming) of per-layer seconds at
   that micro-batch size -- forward + backward, plus the recomputed forward when
   checkpointing -- where a stage that ends at a boundary also pays for sending its
   output and receiving the gradient over the cluster's link;
2. **refine with the simulator**: the partition and its neighbours (one layer moved
   across one boundary) are simulated; the fastest that fits the budget is kept.

Plans are ranked by predicted throughput.  No returned plan exceeds the budget on any
device; if none fits, the error says the smallest peak any candidate needs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pandas as pd
from tqdm.auto import tqdm

from pipesim.allocator import CUDA_H100, CachingAllocator, reserved_peaks
from pipesim.balance import block_partition, min_max_partition
from pipesim.cluster import Cluster
from pipesim.errors import PlanError
from pipesim.plan import CHECKPOINT_MODES, V_SCHEDULES, Plan
from pipesim.profile import Profile
from pipesim.schedule import SCHEDULES, program
from pipesim.simulator import simulate
from pipesim.trace import metrics

#: plans predicted within this share of the fastest are as fast as the model can tell
#: (its median error pooled over the CPU grids is 1.6%, a single grid's 4-9%; GPipe and
#: 1F1B at a few micro-batches often differ by less than 0.01% of their time while 1F1B
#: holds a fraction of GPipe's activations): among them the smallest peak wins
TIE = 0.005


@dataclass
class TuneResult:
    """Ranked plans (best first) and every candidate simulated."""

    plans: list[Plan]
    table: pd.DataFrame  # one row per candidate: plan fields, predicted metrics, fits

    @property
    def best(self) -> Plan:
        return self.plans[0]


def _measured_for_every_stage(plan: Plan, read: Callable[[int, int, int, bool], object]
                              ) -> bool:
    """Whether ``read(first, stop, size, checkpointed)`` finds a measurement (anything but
    None or empty) for every stage's span of ``plan``, in each checkpoint mode it uses."""
    size = plan.micro_batch_sizes[0]
    modes = {plan.checkpointed(m) for m in range(plan.n_microbatches)}
    return all(read(layers.start, layers.stop, size, mode) not in (None, ())
               for layers in (plan.stage_layers(s) for s in range(plan.n_stages))
               for mode in modes)


def _priced_in_place(plan: Plan, cluster: Cluster) -> bool:
    """Whether every action of ``plan`` is priced by its stage's cost measured in place
    (:attr:`pipesim.cluster.Cluster.in_place_costs`: each stage's span in each checkpoint
    mode the plan uses)."""
    return _measured_for_every_stage(plan, cluster.in_place_cost)


def _priced_after_waits(plan: Plan, cluster: Cluster) -> bool:
    """Whether every stage of ``plan`` has its idle costs measured
    (:attr:`pipesim.cluster.Cluster.idle_costs`, its forward's in each checkpoint mode the
    plan uses): read against the profile, they also carry each stage's pace in place, so a
    plan with them and one without are priced by two rulers."""
    return _measured_for_every_stage(
        plan, lambda first, stop, size, mode: cluster.idle_cost(first, stop, size, mode, "F"))


def _priced_in_order(plan: Plan, cluster: Cluster) -> bool:
    """Whether every stage of ``plan`` has its run-on costs measured
    (:attr:`pipesim.cluster.Cluster.run_on_costs`, its forward's in each checkpoint mode
    the plan uses): a GPipe plan with them runs cheaper than one without."""
    return _measured_for_every_stage(
        plan, lambda first, stop, size, mode: next(
            (x for x in cluster.run_on_costs if (x.first, x.stop, x.checkpointed, x.kind)
             == (first, stop, mode, "F")), None))


def _priced_beside_others(plan: Plan, cluster: Cluster) -> bool:
    """Whether every stage of ``plan`` has its slowdown beside the other ranks measured in
    place (:attr:`pipesim.cluster.Cluster.host_slowdowns`): a plan without runs at the host
    law alone, which reads it cheaper."""
    return _measured_for_every_stage(
        plan, lambda first, stop, size, _mode: cluster.host_slowdown(first, stop, size))


def _warn_of_two_rulers(table: pd.DataFrame, column: str, what: str) -> None:
    """Warn where some candidates, not all, are priced by measurements in place
    (``table[column]`` true) and the others by the profile alone."""
    if column in table and 0 < table[column].sum() < len(table):
        warnings.warn(
            f"tune: {int(table[column].sum())} of {len(table)} candidates have {what}, the "
            "others are priced by the profile: two rulers, whose ranking favours whichever "
            "reads cheaper; measure every balance the tuner tries, or none (see the table's "
            f"'{column}' column)", stacklevel=3)


def stage_balance(profile: Profile, n_stages: int, micro_batch: float, checkpoint: str,
                  cluster: Cluster | None = None, method: str = "minmax") -> list[int]:
    """Balance for ``n_stages`` at ``micro_batch`` samples (``minmax`` exact, or ``block``)."""
    cols = profile.columns_at(micro_batch)
    costs = cols["fwd_s"] + cols["bwd_s"]
    if checkpoint != "never":
        costs = costs + cols["fwd_s"]
    if method == "block":
        return block_partition(costs, n_stages)
    edge = None
    if cluster is not None and cluster.n_devices > 1:
        link = cluster.link_between(0, 1)
        edge = [2 * link.seconds(b) for b in cols["output_bytes"]]
    return min_max_partition(costs, n_stages, edge)


def _neighbours(balance: Sequence[int]) -> Iterable[list[int]]:
    yield list(balance)
    for i in range(len(balance) - 1):
        for step in (-1, 1):
            b = list(balance)
            b[i] += step
            b[i + 1] -= step
            if min(b) >= 1:
                yield b


def chunk_counts(profile: Profile, batch_size: int, chunks: Sequence[int] | None = None
                 ) -> list[int]:
    """The chunk counts the tuner tries for ``batch_size`` samples: ``chunks`` (default
    powers of two up to the batch size) whose micro-batches all fall in the profiled
    range of sizes; a PlanError where none does."""
    lo, hi = min(profile.micro_batch_sizes), max(profile.micro_batch_sizes)
    if chunks is None:
        chunks = [2**k for k in range(int(math.log2(batch_size)) + 1)]
    chunks = [c for c in chunks if c <= batch_size and lo <= math.ceil(batch_size / c) <= hi
              and min(Plan([1], c, batch_size).micro_batch_sizes) >= lo]
    if not chunks:
        raise PlanError(f"no chunks count splits {batch_size} samples into micro-batches inside "
                        f"the profiled range [{lo}, {hi}]")
    return chunks


def tuned_balances(profile: Profile, n_stages: int, batch_size: int, *,
                   cluster: Cluster | None = None, chunks: Sequence[int] | None = None,
                   checkpoints: Sequence[str] = CHECKPOINT_MODES, method: str = "minmax",
                   refine: bool = True) -> list[list[int]]:
    """Every balance of ``n_stages`` stages that :func:`tune` tries with one stage a
    device (every schedule but the interleaved and V-shaped ones), in the order it first
    meets them: what to measure in place so that the tuner ranks all its candidates by
    one ruler (:attr:`pipesim.cluster.Cluster.in_place_costs`)."""
    out: list[list[int]] = []
    for c in chunk_counts(profile, batch_size, chunks):
        for ckpt in checkpoints:
            base = stage_balance(profile, n_stages, math.ceil(batch_size / c), ckpt, cluster,
                                 method)
            out += [b for b in (_neighbours(base) if refine else [base]) if b not in out]
    return out


def tune(profile: Profile, n_devices: int, batch_size: int, memory_budget: float, *,
         cluster: Cluster | None = None, chunks: Sequence[int] | None = None,
         checkpoints: Sequence[str] = CHECKPOINT_MODES,
         schedules: Sequence[str] = ("gpipe", "1f1b"), method: str = "minmax",
         refine: bool = True, optimizer: str | float = "sgd",
         virtual_stages: Sequence[int] = (2, 3), progress: bool = False,
         margin: float = 0.10, allocator: CachingAllocator = CUDA_H100,
         tie: float = TIE) -> TuneResult:
    """Ranked plans for ``batch_size`` samples on ``n_devices`` within ``memory_budget`` bytes.

    ``chunks`` defaults to powers of two up to the batch size whose micro-batches fall in
    the profiled range.  ``method='block'`` balances by torchgpipe-style greedy blocks
    instead of the exact partition (for comparison).  ``schedules`` may name any of
    :data:`pipesim.schedule.SCHEDULES`; ``interleaved`` is tried with each of
    ``virtual_stages`` stages a device (where the layers and the micro-batches allow),
    ``zbv`` with its two.  A plan fits when its predicted peak on every device, plus
    ``margin`` of it, is within both the budget and that device's ``memory_bytes``: the
    default 10% covers every one of the 312 device peaks of the CPU memory grid (under by
    1.0% at most, ``experiments/validate_memory.py``, 2026-11-28) and all but 3 of the 360
    GPU grids' allocated peaks (under by 10.9-12.6%: gpt 1F1B [5,5] ``always``, two threads on one
    GPU; ``experiments/repredict_evidence.py``); 0 trusts the prediction as it is.  On an
    accelerator (a device such as ``cuda:0``) the plan's estimated reserved bytes must fit
    too: what a caching allocator holds, under ``allocator``'s assumptions
    (:mod:`pipesim.allocator`; by default PyTorch's CUDA allocator with an H100's cuBLAS
    workspaces).  ``progress`` shows a bar (on stderr).  Plans that run the same program
    (:func:`pipesim.schedule.program`: GPipe and 1F1B, ``except_last`` and ``never``, at
    one micro-batch) are one candidate, under the name met first.  Plans predicted within
    ``tie`` (a share) of the fastest that fits rank by their peak, the smallest first: the
    model does not tell them apart (see :data:`TIE`).
    """
    if margin < 0:
        raise PlanError(f"margin must be >= 0, got {margin}")
    if not 0 <= tie < 1:
        raise PlanError(f"tie must be in [0, 1), got {tie}")
    if n_devices > profile.n_layers:
        raise PlanError(f"{n_devices} devices is more than the {profile.n_layers} layers")
    cluster = cluster or Cluster.free(n_devices)
    chunks = chunk_counts(profile, batch_size, chunks)
    # per physical device: the tighter of the budget and its memory
    limit: dict[str, float] = {}
    for d in cluster.devices[:n_devices]:
        limit[d.resource] = min(limit.get(d.resource, math.inf), memory_budget, d.memory_bytes)
    # physical devices whose allocator reserves beyond what is allocated
    cached = {d.resource for d in cluster.devices[:n_devices] if d.on_accelerator}
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise PlanError(f"unknown schedule(s) {unknown}; choose of {', '.join(SCHEDULES)}")
    # stages a device: interleaved tries each of virtual_stages, a V always has two
    stacked = {"interleaved": tuple(virtual_stages), **{s: (2,) for s in V_SCHEDULES}}
    shapes = [(s, v) for s in schedules for v in stacked.get(s, (1,))
              if n_devices * v <= profile.n_layers]
    rows, seen = [], set()
    bar = tqdm(total=len(chunks) * len(checkpoints) * len(shapes), desc="tuning", unit="shape",
               disable=not progress, leave=False)
    for c in chunks:
        size = math.ceil(batch_size / c)
        for ckpt in checkpoints:
            for schedule, v in shapes:
                bar.update(1)
                if schedule == "interleaved" and c % n_devices:
                    continue  # interleaving needs micro-batches in multiples of the devices
                base = stage_balance(profile, n_devices * v, size, ckpt, cluster, method)
                for balance in (_neighbours(base) if refine else [base]):
                    plan = Plan(balance, c, batch_size, checkpoint=ckpt, schedule=schedule,
                                optimizer=optimizer, virtual_stages=v)
                    # a plan that runs what one met before does (GPipe and 1F1B, or
                    # except_last and never, at one micro-batch) is that plan
                    key = program(plan)
                    if key in seen:
                        continue
                    seen.add(key)
                    trace = simulate(profile, plan, cluster)
                    m = metrics(trace)
                    peak = max(m.peak_memory_bytes.values())
                    fits = all(p * (1 + margin) <= limit.get(d, memory_budget)
                               for d, p in m.peak_memory_bytes.items())
                    reserved = ({d: r for d, r in reserved_peaks(trace, allocator).items()
                                 if d in cached} if cached else {})
                    fits = fits and all(r <= limit.get(d, memory_budget)
                                        for d, r in reserved.items())
                    rows.append({"plan": plan, "balance": ",".join(map(str, balance)),
                                 "chunks": c, "checkpoint": ckpt, "schedule": schedule,
                                 "virtual_stages": v,
                                 "iteration_s": m.iteration_time_s, "throughput": m.throughput,
                                 "bubble": m.mean_bubble, "peak_bytes": peak,
                                 "reserved_bytes": max(reserved.values(), default=math.nan),
                                 "fits": fits, "from_partition": balance == base,
                                 **({"in_place": _priced_in_place(plan, cluster)}
                                    if cluster.in_place_costs else {}),
                                 **({"idle_costs": _priced_after_waits(plan, cluster)}
                                    if cluster.idle_costs else {}),
                                 **({"run_on_costs": _priced_in_order(plan, cluster)}
                                    if cluster.run_on_costs else {}),
                                 **({"host_slowdowns": _priced_beside_others(plan, cluster)}
                                    if cluster.host_slowdowns else {})})
    bar.close()
    table = pd.DataFrame(rows)
    _warn_of_two_rulers(table, "in_place",
                        "every stage measured in place (cluster.in_place_costs)")
    _warn_of_two_rulers(table, "idle_costs", "every stage's idle costs measured (cluster."
                        "idle_costs; `pipesim calibrate --idle-costs PROFILE --balance tuned`)")
    _warn_of_two_rulers(table, "run_on_costs", "every stage's run-on costs measured "
                        "(cluster.run_on_costs)")
    _warn_of_two_rulers(table, "host_slowdowns", "every stage's slowdown beside the others "
                        "measured (cluster.host_slowdowns; `pipesim calibrate --idle-costs "
                        "PROFILE --balance tuned`)")
    fitting = _ranked(table[table["fits"]], tie)
    if fitting.empty:
        smallest = table.sort_values("peak_bytes").iloc[0]
        tightest = min(limit.values())
        raise PlanError(f"no plan fits {tightest / 2**20:.3f} MiB per device (the budget, or a "
                        f"device's memory if smaller) with a {margin:.0%} margin; the smallest "
                        f"peak any plan needs is {smallest.peak_bytes / 2**20:.3f} MiB "
                        f"({smallest.plan.label()})"
                        + (f", its estimated reserved {smallest.reserved_bytes / 2**20:.3f} MiB"
                           if cached else ""))
    rest = table[~table["fits"]].sort_values("throughput", ascending=False)
    table = pd.concat([fitting, rest]).reset_index(drop=True)
    return TuneResult(list(fitting["plan"]), table)


def _ranked(fitting: pd.DataFrame, tie: float) -> pd.DataFrame:
    """``fitting`` best first: those within ``tie`` of the fastest throughput by their
    peak (smallest first), then the others by throughput::

        throughput  100  99.8  97   (tie 0.005: 99.5 and up tie)
        peak MiB     36  22    10   ->  99.8 (22 MiB), 100 (36 MiB), 97 (10 MiB)
    """
    if fitting.empty:
        return fitting
    near = fitting["throughput"] >= fitting["throughput"].max() * (1.0 - tie)
    return pd.concat([
        fitting[near].sort_values(["peak_bytes", "throughput"], ascending=[True, False]),
        fitting[~near].sort_values(["throughput", "peak_bytes"], ascending=[False, True])])
