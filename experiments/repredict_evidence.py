"""Re-predict every recorded GPU and 16-core run from its own profile and calibration.

The GPU check anyone can run without a GPU.  Sources, under
``../shared/evidence/h100-2026-11-22/`` (or ``--evidence DIR``):

* ``traces/<model>_<dtype>/``: 12 plans each with the measured Trace (iteration time and
  bubble), its ``profile.csv`` and ``cluster.json``.  The run calibrated the executor's
  overheads once per model on the same tiny pipeline: the four readings are pooled
  (their median, :func:`pooled_overheads`).  The profiles predate the checkpoint's
  columns and the measured concurrency law: both are carried over from the 2026-11-23
  run's profile of the same model and dtype on the same kind of GPU;
* ``grid_2stages/validation_gpu.csv``: 240 plans (gpt, mlp x fp32, bf16; two stages as
  threads on one H100), profiles and calibration beside it;
* ``cpu16/``: 4 (and 8) pinned CPU processes on 16 cores, profiles and calibrations;
  the project's own later 16-core grids (``experiments/results/gpu/validation_cpu_*``,
  2026-11-26, and ``h200-2026-11-27/``: mlp with idle costs) beside them, as run and
  re-predicted (:func:`cpu16_latest`, :data:`CPU16_GRIDS`);

and the project's latest GPU run, ``experiments/results/gpu/`` (2026-11-23, the same grid
on an H100 with long-lived workers and the measured concurrency law, each plan's memory
freed before the next): iteration time, and peak allocated memory against the allocator's.

Each plan is predicted under every model variant (an ablation: one mechanism added at a
time) and the table prints median and max |error| of iteration time (and bubble where a
trace exists) per source, model and dtype, beside the source's own noise floor (GPipe
and 1F1B at one micro-batch run the same actions: :func:`noise_floors`).  Nothing is
fitted to these plans: every
number comes from the recorded profile and the calibration measured beside it.  The bf16
runs were recorded with fresh worker threads each step (a defect of that executor: a
thread's first bf16 matmul pays tens of ms), so they are reported apart and that defect
is not modelled.

    python experiments/repredict_evidence.py [--evidence DIR] [--sources ...] [--grid DIR ...]
Writes experiments/results/repredict_evidence.csv (one row per plan and variant),
repredict_evidence_summary.csv and repredict_evidence_memory.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import pandas as pd

from experiments.common import write_results
from experiments.validation import noise_floor, plan_columns, predict_saved
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.readings import in_place_costs_of
from pipesim.simulator import simulate
from pipesim.trace import Trace, metrics

EVIDENCE = ROOT.parent / "shared" / "evidence" / "h100-2026-11-22"

#: the project's latest GPU run (2026-11-23 on an H100: the same grid, the executor's
#: long-lived workers, the measured concurrency law, each plan's memory freed before the next)
LATEST_GPU = ROOT / "experiments" / "results" / "gpu"

Model = tuple[Profile, Cluster]


def _without_law(profile: Profile) -> Profile:
    meta = {k: v for k, v in profile.meta.items() if k != "stream_speedup"}
    return Profile(profile.table, meta, profile.source)


#: variant name -> how it changes the recorded profile and cluster (one mechanism at a
#: time); None where the mechanism's measurement is missing from that source
VARIANTS: dict[str, Callable[[Profile, Cluster], Model | None]] = {
    # what the runs were predicted with: workers on one GPU take turns
    "recorded": lambda p, c: (_without_law(p), dataclasses.replace(c, device_sharing="serial")),
    # + streams of one GPU run concurrently, law read off the profile's size scaling
    "concurrent_streams": lambda p, c: (_without_law(p),
                                        dataclasses.replace(c, device_sharing="concurrent")),
    # + the law measured (threads with their own streams, together against alone)
    "measured_streams": lambda p, c: ((p, dataclasses.replace(c, device_sharing="concurrent"))
                                      if "stream_speedup" in p.meta else None),
    # the size-scaling law (the device alone) with the workers as threads of one process:
    # their backwards issued in turn by autograd's one thread for the GPU, for the host
    # seconds the profile measured (no interpreter share was measured in these runs)
    "threads_engine": lambda p, c: ((_without_law(p), _threads(c))
                                    if "host_bwd_s" in p.table and _on_gpu(c) else None),
    # + a forward's host issue holding the interpreter (no share was measured in these
    # runs: assumed from the host columns, as forwards hold it wholly on CPU threads; a
    # checkpointed forward's hooks too, and the recomputation autograd's thread runs for
    # a checkpointed backward)
    "threads_host_gil": lambda p, c: ((_with_host_shares(_without_law(p)), _threads(c))
                                      if "host_fwd_s" in p.table and "ckpt_fwd_s" in p.table
                                      and _on_gpu(c) else None),
    # + autograd's thread serving the backward of the thread whose forwards create more
    # autograd nodes first (its sequence numbers run ahead): the nodes counted on the
    # built-in model of the same layers (the recorded profiles predate the column)
    "threads_node_order": lambda p, c: ((_with_autograd_nodes(_with_host_shares(_without_law(p))),
                                         _threads(c))
                                        if "host_fwd_s" in p.table and "ckpt_fwd_s" in p.table
                                        and _on_gpu(c) else None),
    # + a checkpointed backward's unpack hooks (Python, on autograd's thread) holding the
    # interpreter for all of its issue there (no share was measured in these runs: assumed;
    # the profiler measures it now, a checkpointed backward beside another thread's
    # forwards against a plain one, executor.profiler.measure_engine_interpreter_share)
    "threads_ckpt_hooks": lambda p, c: (
        (_with_hook_shares(_with_autograd_nodes(_with_host_shares(_without_law(p)))), _threads(c))
        if "host_fwd_s" in p.table and "ckpt_fwd_s" in p.table and _on_gpu(c) else None),
    # threads_node_order, and a launch-bound checkpointed backward (its backward issued in
    # 90% of its device seconds or more, by the run's own host columns) holding autograd's
    # device thread for all its seconds: no share was measured in these runs; the H200's
    # profile of the same gpt fp32 (2026-11-26) measured two threads' checkpointed
    # backwards together at 1.96x one alone at 2 samples (Bc 0.98), where the pair is
    # launch-bound (at 4 samples and up the device bounds it, as the law charges)
    "threads_ckpt_engine": lambda p, c: (
        (_with_autograd_nodes(_with_host_shares(_without_law(p), launch_bound=0.9)),
         _threads(c))
        if "host_fwd_s" in p.table and "ckpt_fwd_s" in p.table and _on_gpu(c) else None),
    # threads_node_order with a recomputation taking turns on autograd's thread beside the
    # other thread's backward nodes (its recomputation included), as before 2026-11-28:
    # the ablation of Cluster.recompute_holds_engine, on in every threads_* variant
    "threads_recompute_turns": lambda p, c: _node_order_with(p, c, recompute_holds_engine=False),
    # threads_node_order with a plain backward holding autograd's thread for nothing (the
    # host columns of backwards zeroed; a recomputation still holds it for its forward's):
    # a what-if of what that hold stands in for, not a model (pipesim/MODEL.md, session 45)
    "threads_no_bwd_hold": lambda p, c: VARIANTS["threads_node_order"](_without_bwd_hold(p), c),
    # threads_node_order, and each worker's host going on once it has issued an action
    # (its measured host seconds; a backward's, autograd's thread issuing it): the gap to
    # its next action hides behind the device's work where the host is ahead
    # (Cluster.issue_ahead; nothing assumed: the host columns are measured)
    "threads_issue_ahead": lambda p, c: _node_order_with(p, c, issue_ahead=True),
    # threads_node_order, and the executor's own seconds between a worker's actions
    # holding the interpreter, in turn with the other threads' share of theirs
    # (Cluster.gaps_hold_interpreter; nothing assumed: the gaps are the calibration's)
    "threads_gaps": lambda p, c: _node_order_with(p, c, gaps_hold_interpreter=True),
    # the workers as threads of one process, each pass slowed by the pass beside it as
    # the profile measured the pairs (profile(..., pairs=True); Cluster.thread_pairs, in
    # place of the interpreter's, engine's and device's turns); runs before 2026-11-27
    # have none
    "threads_pairs": lambda p, c: ((p, dataclasses.replace(_threads(c), thread_pairs=True))
                                   if "pair_slowdown" in p.meta and _on_gpu(c) else None),
}


#: the variants predicted again where a grid's folder has its stages' costs measured in
#: place on the GPU (``gpu_validate.py``, :class:`pipesim.readings.InPlaceCost`), each
#: action at that lone cost: name -> the :data:`VARIANTS` entry it builds on
IN_PLACE_VARIANTS = {"in_place_costs": "measured_streams",
                     "in_place_threads": "threads_engine",
                     "in_place_issue_ahead": "threads_issue_ahead",
                     "in_place_pairs": "threads_pairs",
                     "in_place_gaps": "threads_gaps"}


def _without_bwd_hold(profile: Profile) -> Profile:
    """``profile`` with no host seconds for any layer's backward (``host_bwd_s`` 0, where
    the column is): a backward then issues in no time on autograd's thread."""
    if "host_bwd_s" not in profile.table:
        return profile
    return Profile(profile.table.assign(host_bwd_s=0.0), profile.meta, profile.source)


def _with_hook_shares(profile: Profile) -> Profile:
    """``profile`` with ``meta["engine_interpreter_share"]`` assumed where it has none: a
    plain backward none of its seconds on autograd's thread (C++), a checkpointed one all
    (its unpack hooks wait their turn for the interpreter at every saved tensor)."""
    if "engine_interpreter_share" in profile.meta:
        return profile
    shares = {str(b): {"B": 0.0, "Bc": 1.0} for b in profile.micro_batch_sizes}
    return Profile(profile.table, {**profile.meta, "engine_interpreter_share": shares},
                   profile.source)


def _with_autograd_nodes(profile: Profile) -> Profile:
    """``profile`` with its ``autograd_nodes`` column where it lacks one, counted by the
    profiler on the built-in model its layers are (``gpt``: Embedding, Blocks, Head;
    ``mlp``: LinearReLU layers and a Linear) at its depth.  A node count depends on the
    layers' operations, not on their widths or the dtype, so a small model on the CPU
    counts what the recorded one created on the GPU."""
    if "autograd_nodes" in profile.table:
        return profile
    counts = _node_counts(tuple(profile.layer_names))
    table = profile.table.assign(autograd_nodes=profile.table.layer.map(dict(enumerate(counts))))
    return Profile(table, profile.meta, profile.source)


@functools.cache
def _node_counts(names: tuple[str, ...]) -> tuple[int, ...]:
    from executor.models import build_model
    from executor.profiler import profile as profile_model

    if names[0] == "Embedding":
        built = build_model("gpt", vocab=64, d_model=32, n_layers=len(names) - 2, n_heads=4,
                            seq_len=8)
    elif names[0] == "LinearReLU":
        built = build_model("mlp", width=16, depth=len(names) - 1)
    else:
        raise ValueError(f"no built-in model has the layers {names}")
    mine = [type(layer).__name__ for layer in built.module]
    if tuple(mine) != names:
        raise ValueError(f"the built-in model's layers {mine} are not the profile's {names}")
    batch = built.make_batch(2)
    counted = profile_model(built.module, batch, [2], loss_fn=built.loss_fn, repeats=1,
                            warmup=0, progress=False, checkpointed=False, split=False)
    return tuple(int(v) for v in counted.table.sort_values("layer").autograd_nodes)


def _with_host_shares(profile: Profile, launch_bound: float | None = None) -> Profile:
    """``profile`` with ``meta["interpreter_share"]`` assumed from its host columns: a
    forward holds the interpreter for its host seconds, a checkpointed one for those and
    the checkpoint's extra seconds (its Python hooks); backwards none (autograd's engine
    thread issues them, :attr:`pipesim.cluster.Device.engine`, for their host seconds).
    With ``launch_bound``, a checkpointed backward at a size whose backward issues in at
    least that share of its device seconds holds autograd's device thread for all its
    seconds (``Bc`` 1: two threads' such backwards cannot run at once)."""
    sums = profile.table.groupby("micro_batch")[
        ["fwd_s", "host_fwd_s", "ckpt_fwd_s", "bwd_s", "host_bwd_s"]].sum()
    shares = {}
    for size, r in sums.iterrows():
        hooks = max(r.ckpt_fwd_s - r.fwd_s, 0.0)
        bound = launch_bound is not None and r.host_bwd_s >= launch_bound * r.bwd_s
        shares[str(size)] = {"F": min(r.host_fwd_s / r.fwd_s, 1.0), "B": 0.0,
                             "Fc": min((r.host_fwd_s + hooks) / r.ckpt_fwd_s, 1.0),
                             "Bc": 1.0 if bound else 0.0}
    return Profile(profile.table, {**profile.meta, "interpreter_share": shares}, profile.source)


def _node_order_with(profile: Profile, cluster: Cluster, **fields) -> Model | None:
    """The ``threads_node_order`` variant with ``fields`` of its cluster replaced (None
    where that variant does not apply)."""
    model = VARIANTS["threads_node_order"](profile, cluster)
    return None if model is None else (model[0], dataclasses.replace(model[1], **fields))


def _threads(cluster: Cluster) -> Cluster:
    return dataclasses.replace(cluster, device_sharing="concurrent", devices=[
        dataclasses.replace(d, process="workers") for d in cluster.devices])


def _on_gpu(cluster: Cluster) -> bool:
    return all(d.physical.startswith("cuda") for d in cluster.devices)


def _with_host_times(profile: Profile, folder: Path) -> Profile:
    """``profile`` with ``host_fwd_s``/``host_bwd_s`` from the trace folder's
    ``host_vs_device.csv`` (the issuing call's seconds beside CUDA-event seconds of the same
    work, per layer and size): each layer's host share of that measurement applied to the
    profile's own device seconds."""
    table = pd.read_csv(folder / "host_vs_device.csv").rename(columns={"size": "micro_batch"})
    shares = table.assign(fwd=table.host_fwd_s / table.dev_fwd_s,
                          bwd=table.host_bwd_s / table.dev_bwd_s)[["micro_batch", "layer", "fwd", "bwd"]]
    merged = profile.table.merge(shares, on=["micro_batch", "layer"], how="left")
    merged["host_fwd_s"] = merged.fwd_s * merged.fwd
    merged["host_bwd_s"] = merged.bwd_s * merged.bwd
    return Profile(merged.drop(columns=["fwd", "bwd"]), profile.meta, profile.source)


#: the profile columns that time each layer inside torch.utils.checkpoint
CHECKPOINT_COLUMNS = ("ckpt_fwd_s", "ckpt_bwd_s")


def _with_checkpoint_costs(profile: Profile, other: Path) -> Profile:
    """``profile`` with the checkpoint's own seconds (``ckpt_fwd_s``/``ckpt_bwd_s``) where
    it lacks them, from the profile ``other`` of the same model on the same kind of GPU.

    The 2026-11-22 traces were profiled before the profiler timed layers inside
    torch.utils.checkpoint; the 2026-11-23 profile of the same model (same layers, bytes,
    dtype, GPU and torch) did.  What the checkpoint adds is host work (its Python hooks,
    the random state), and what it saves where the device bounds a layer (a backward
    reading freshly recomputed activations: negative), so each layer's extra seconds at
    each size (``ckpt_fwd_s - fwd_s``, ``ckpt_bwd_s - fwd_s - bwd_s``) are carried over as
    measured, added to this profile's own ``fwd_s`` and ``bwd_s``; likewise the whole
    model's, checkpointed as one call, so that a stage pays the checkpoint's entry once,
    not once a layer (:meth:`Profile.isolation_excess`), and keeps a saving as far as the
    whole model measured one (:meth:`Profile.checkpoint_saving`).  A profile that has the
    columns, or an ``other`` of another shape, is returned unchanged."""
    if all(c in profile.table for c in CHECKPOINT_COLUMNS) or not other.exists():
        return profile
    donor = Profile.load(other)
    theirs = donor.table
    keys = ["layer", "micro_batch"]
    if not all(c in theirs for c in CHECKPOINT_COLUMNS) or len(theirs) != len(profile.table):
        return profile
    extra = theirs.assign(fwd_extra=theirs.ckpt_fwd_s - theirs.fwd_s,
                          bwd_extra=theirs.ckpt_bwd_s - theirs.fwd_s - theirs.bwd_s)
    merged = profile.table.merge(extra[[*keys, "param_bytes", "fwd_extra", "bwd_extra"]],
                                 on=keys, how="left", suffixes=("", "_other"))
    if merged.fwd_extra.isna().any() or (merged.param_bytes != merged.param_bytes_other).any():
        return profile
    merged["ckpt_fwd_s"] = merged.fwd_s + merged.fwd_extra
    merged["ckpt_bwd_s"] = merged.fwd_s + merged.bwd_s + merged.bwd_extra
    table = merged.drop(columns=["param_bytes_other", "fwd_extra", "bwd_extra"])
    # and the whole model checkpointed as one call (the profiler's isolation correction:
    # a stage enters the checkpoint once, not once a layer)
    whole = {size: dict(times) for size, times in profile.meta.get("whole_model", {}).items()}
    their_whole = donor.meta.get("whole_model", {})
    for size, times in whole.items():
        t = their_whole.get(size, {})
        if "ckpt_fwd_s" in t and "ckpt_bwd_s" in t:
            times["ckpt_fwd_s"] = times["fwd_s"] + t["ckpt_fwd_s"] - t["fwd_s"]
            times["ckpt_bwd_s"] = (times["fwd_s"] + times["bwd_s"]
                                   + t["ckpt_bwd_s"] - t["fwd_s"] - t["bwd_s"])
    meta = {**profile.meta, "whole_model": whole, "checkpoint_costs_from": str(other)}
    return Profile(table, meta, profile.source)


def measured_laws(folder: Path) -> dict[str, dict[str, list[float]]]:
    """The concurrency laws a ``gpu_validate.py`` run in ``folder`` measured (two threads
    with their own streams on the GPU, together against alone), by grid label
    (``"gpt/float32/2st"``) and micro-batch size; empty where it wrote none."""
    laws_file = folder / "device_speedup.json"
    if not laws_file.exists():
        return {}
    return {label: {size: law["measured"] for size, law in by_size.items()}
            for label, by_size in json.loads(laws_file.read_text()).items()}


def _with_stream_law(profile: Profile, folder: Path, label: str) -> Profile:
    """``profile`` with ``meta["stream_speedup"]`` from the run in ``folder`` where it
    lacks one: the law measured for ``label`` there (a run that wrote it only to
    ``device_speedup.json``, before profiles carried it, or one of the same model, dtype,
    GPU and torch measured a day later, for profiles that predate the measurement).  It is
    borrowed only where the two profiles are of the same layers (names and parameter
    bytes at every size) and the law covers every size of ``profile``."""
    if "stream_speedup" in profile.meta:
        return profile
    law = measured_laws(folder).get(label)
    if not law or {str(b) for b in profile.micro_batch_sizes} - set(law):
        return profile
    model, dtype = label.split("/")[:2]
    donor = folder / f"profile_{model}_{dtype}.csv"
    # (the run's own profile, as the grid's is, needs no comparing with itself)
    if (donor.exists() and str(donor) != profile.source
            and not _same_layers(profile, Profile.load(donor))):
        return profile
    return Profile(profile.table, {**profile.meta, "stream_speedup": law}, profile.source)


def _same_layers(a: Profile, b: Profile) -> bool:
    """Whether two profiles are of the same layers: names and parameter bytes, layer by
    layer, at the same sizes."""
    keys = ["layer", "micro_batch", "name", "param_bytes"]

    def rows(p: Profile) -> pd.DataFrame:
        return p.table[keys].sort_values(keys[:2]).reset_index(drop=True)

    return len(a.table) == len(b.table) and rows(a).equals(rows(b))


def _predict(profile: Profile, plan: Plan, cluster: Cluster) -> tuple[float, float]:
    m = metrics(simulate(profile, plan, cluster, track_memory=False))
    return m.iteration_time_s, m.mean_bubble


def _variants(source: str, model: str, dtype: str, profile: Profile, cluster: Cluster, plan: Plan,
              measured_ms: float, bubble_meas: float,
              variants: dict[str, str] | None = None) -> list[dict]:
    """One row per model variant for a plan measured in ``source`` (``variants``: name ->
    the :data:`VARIANTS` entry it applies, by default each under its own name)."""
    rows = []
    for variant, base in (variants or {v: v for v in VARIANTS}).items():
        change = VARIANTS[base]
        changed = change(profile, cluster)
        if changed is None:
            continue
        it, bubble = _predict(changed[0], plan, changed[1])
        rows.append({"source": source, **plan_columns(model, plan), "dtype": dtype,
                     "plan": plan.label(), "variant": variant, "predicted_ms": it * 1e3,
                     "measured_ms": measured_ms, "bubble_pred": bubble,
                     "bubble_meas": bubble_meas})
    return rows


def _plan(balance: str, chunks: int, checkpoint: str, schedule: str) -> Plan:
    return Plan([int(b) for b in balance.split(",")], int(chunks), 32, checkpoint=checkpoint,
                schedule=schedule, optimizer="sgd")


#: the executor's overheads a Cluster holds, measured by one calibration (seconds)
OVERHEADS = ("compute_overhead_s", "action_gap_s", "wakeup_gap_s")


def pooled_overheads(clusters: list[Cluster]) -> dict[str, float]:
    """The median of each executor overhead (:data:`OVERHEADS`) over ``clusters``
    calibrated in one run on one machine.  The figures are the executor's, measured on the
    same tiny pipeline whatever model the calibration was taken for, so several of them
    are repeated readings of one quantity, and one reading is noisy: the four of the
    recorded traces read 0.0, 0.001, 0.064 and 0.185 ms in action
    (:func:`executor.calibrate.measure_thread_overhead`, which now takes the median of
    three readings itself).  A figure no cluster has (None) is left out."""
    pooled = {}
    for name in OVERHEADS:
        values = [v for c in clusters if (v := getattr(c, name)) is not None]
        if values:
            pooled[name] = float(np.median(values))
    return pooled


def trace_runs(evidence: Path) -> Iterator[tuple[str, str, Profile, Cluster, Plan, Trace]]:
    """``(model, dtype, profile, cluster, plan, measured)`` for every recorded trace: its
    profile completed as :func:`traces` describes, each model's calibration with the
    run's overheads pooled (:func:`pooled_overheads`)."""
    folders = sorted(f for f in (evidence / "traces").iterdir() if f.is_dir())
    clusters = {f: Cluster.load(f / "cluster.json") for f in folders}
    pooled = pooled_overheads(list(clusters.values()))
    for folder in folders:
        model, dtype = folder.name.split("_")
        profile = _with_stream_law(_with_checkpoint_costs(
            _with_host_times(Profile.load(folder / "profile.csv"), folder),
            LATEST_GPU / f"profile_{model}_{dtype}.csv"), LATEST_GPU, f"{model}/{dtype}/2st")
        cluster = dataclasses.replace(clusters[folder], **pooled)
        for run in sorted(p for p in folder.iterdir() if p.is_dir()):
            measured = Trace.load(run, "measured")
            yield (model, dtype, profile, cluster,
                   Plan.from_dict(measured.meta["plan"], source=str(run)), measured)


def traces(evidence: Path) -> list[dict]:
    """Rows for the recorded traces: measured iteration and bubble, predicted per variant
    (:func:`trace_runs`)."""
    rows = []
    for model, dtype, profile, cluster, plan, measured in trace_runs(evidence):
        meas = metrics(measured)
        rows += _variants("traces", model, dtype, profile, cluster, plan,
                          meas.iteration_time_s * 1e3, meas.mean_bubble)
    return rows


def grid_2stages(evidence: Path) -> list[dict]:
    """Rows for the 240-plan GPU grid of the evidence (iteration times: no traces kept)."""
    return _gpu_grid("grid_2stages", evidence / "grid_2stages")


def grid_gpu_results(_evidence: Path) -> list[dict]:
    """Rows for the project's latest GPU grid, :data:`LATEST_GPU`."""
    return _gpu_grid("gpu_results", LATEST_GPU)


#: the H200's 2-stage fp32 grid of 2026-11-26, its profiles with the interpreter shares
#: measured (its README)
H200_GRID = LATEST_GPU / "h200-2026-11-26-grid"


def grid_h200(_evidence: Path) -> list[dict]:
    """Rows for the H200's grid, :data:`H200_GRID`."""
    return _gpu_grid("h200_grid", H200_GRID)


def _gpu_plans(folder: Path):
    """``(model, dtype, profile, cluster, plan, row)`` for every plan of the
    ``gpu_validate.py`` grid in ``folder``.  Its profiles carry the measured concurrency
    law where the run measured it; a run that wrote it only to ``device_speedup.json``
    (before profiles carried it) has it put back in the profile."""
    table = pd.read_csv(folder / "validation_gpu.csv")
    cluster = Cluster.load(folder / "calibration_2stages.json")
    for (label, dtype), part in table.groupby(["model", "dtype"]):
        model = label.split("/")[0]
        profile = _with_stream_law(Profile.load(folder / f"profile_{model}_{dtype}.csv"),
                                   folder, label)
        for r in part.itertuples():
            yield model, dtype, profile, cluster, _plan(r.balance, r.chunks, r.checkpoint,
                                                        r.schedule), r


def _gpu_grid(source: str, folder: Path) -> list[dict]:
    """Rows for a ``gpu_validate.py`` grid in ``folder`` (iteration times, every variant;
    and ``in_place_costs`` where the folder has the stages' costs measured in place)."""
    in_place = in_place_costs(folder)
    rows = []
    for model, dtype, profile, cluster, plan, r in _gpu_plans(folder):
        rows += _variants(source, model, dtype, profile, cluster, plan, r.measured_ms,
                          r.bubble_meas)
        costs = in_place.get(f"{model}/{dtype}/{plan.n_stages}st")
        if costs:
            rows += _variants(source, model, dtype, profile,
                              dataclasses.replace(cluster,
                                                  in_place_costs=in_place_costs_of(costs)),
                              plan,
                              r.measured_ms, r.bubble_meas, IN_PLACE_VARIANTS)
    return rows


def in_place_costs(folder: Path) -> dict[str, list[dict]]:
    """The stages' costs measured in place on the GPU beside a grid
    (``gpu_validate.py --in-place-only``, ``in_place_costs_gpu*.json``, one file a
    reading): grid label -> rows of :func:`executor.in_place.device_stage_costs`, each
    figure the median of the readings (two readings of MLP's forwards, a minute apart,
    differed by 21% median: host-bound actions of 0.3-0.9 ms); empty where none were."""
    readings = [json.loads(p.read_text())
                for p in sorted(folder.glob("in_place_costs_gpu*.json"))]
    keys = ("first", "stop", "micro_batch", "checkpointed")
    pooled: dict[str, list[dict]] = {}
    for label in sorted({k for r in readings for k in r if not k.startswith("_")}):
        table = pd.DataFrame([row for r in readings for row in r.get(label, ())])
        pooled[label] = [{**dict(zip(keys, key, strict=True)), **part[
            ["fwd_s", "bwd_s", "between_s"]].median().to_dict()}
            for key, part in table.groupby(list(keys))]
    return pooled


def gpu_memory(folder: Path = LATEST_GPU, source: str = "gpu_results") -> pd.DataFrame:
    """Peak allocated of the one GPU (both stages, the caller's batch included) predicted
    for every plan of the grid in ``folder``, beside the allocator's peak and the
    prediction made as it ran.  (Not for the evidence's grid: that executor measured
    peaks without freeing the plans before, -45% to -86% "error" then.)"""
    rows = []
    for model, dtype, profile, cluster, plan, r in _gpu_plans(folder):
        peak = sum(metrics(simulate(profile, plan, cluster)).peak_memory_bytes.values())
        rows.append({"source": source, "model": model, "dtype": dtype,
                     "plan": plan.label(), "peak_pred_bytes": peak + _batch_bytes(model, dtype),
                     "peak_meas_bytes": r.peak_meas_bytes,
                     "peak_pred_bytes_as_run": r.peak_pred_bytes})
    return pd.DataFrame(rows)


def _batch_bytes(model: str, dtype: str) -> int:
    """Bytes of the batch ``gpu_validate.py`` puts on the GPU beside the pipeline (inputs
    and targets, batch 32): gpt token ids and targets (int64, 256 a sample); mlp inputs
    (4096 a sample, in ``dtype``) and class targets (int64)."""
    if model == "gpt":
        return 2 * 32 * 256 * 8
    return 32 * 4096 * (2 if dtype == "bfloat16" else 4) + 32 * 8


def cpu16(evidence: Path) -> list[dict]:
    """Rows for the 16-core runs (4 stages complete, 8 stages as far as the log goes)."""
    folder = evidence / "cpu16"
    table = pd.read_csv(folder / "validation_cpu_4_and_8stages_from_log.csv")
    rows = []
    for (stages, model), part in table.groupby(["stages", "model"]):
        profile = Profile.load(folder / f"profile_cpu_{stages}stages_{model}.csv")
        cluster = Cluster.load(folder / f"calibration_cpu_{stages}stages.json")
        for r in part.itertuples():
            plan = _plan(r.balance, r.chunks, r.ckpt, r.sched)
            rows += _variants(f"cpu16_{stages}ranks", model, "float32", profile, cluster, plan,
                              r.meas, np.nan)
    return rows


#: the project's own 16-core grids (``gpu_run.sh cpu16`` on the H200 machine's host):
#: (folder, ``validate.py`` results tag, source name)
CPU16_GRIDS = (
    (LATEST_GPU, "cpu_4stages", "cpu16_4ranks_latest"),  # 2026-11-26, no idle costs
    (LATEST_GPU, "cpu_8stages", "cpu16_8ranks_latest"),  # the same, its quick 8-rank grid
    # 2026-11-27, mlp with idle costs measured on every rank at once
    (LATEST_GPU / "h200-2026-11-27", "cpu_4stages_mlp", "cpu16_4ranks_1127"),
    # 2026-11-27 evening, the same with receives posted once inputs are in, 1 s a plan
    (LATEST_GPU / "h200-2026-11-27-evening", "cpu_4stages_mlp", "cpu16_4ranks_1127e"),
)


def cpu16_latest(_evidence: Path) -> list[dict]:
    """Rows for the project's own 16-core grids in :data:`CPU16_GRIDS`: ``as_run``, the
    prediction the run made, and ``today``, the same plans predicted again from the run's
    own profiles and readings (``validate.py``'s
    :func:`experiments.validation.predict_saved`)."""
    rows = []
    for folder, tag, source in CPU16_GRIDS:
        if not (folder / f"validation_{tag}.csv").exists():
            continue
        table = predict_saved(folder, tag)
        for r in table.itertuples():
            plan = _plan(str(r.balance), r.chunks, r.checkpoint, r.schedule)
            for variant, predicted in (("as_run", r.predicted_ms), ("today", r.predicted_ms_now)):
                rows.append({"source": source,
                             **plan_columns(r.model, plan), "dtype": "float32",
                             "plan": plan.label(), "variant": variant,
                             "predicted_ms": predicted, "measured_ms": r.measured_ms,
                             "bubble_pred": r.bubble_pred, "bubble_meas": r.bubble_meas})
    return rows


def noise_floors(table: pd.DataFrame) -> pd.DataFrame:
    """Each source's, model's and dtype's own noise: median and max |difference| (%)
    between GPipe and 1F1B at one micro-batch, which run the same actions in the same
    order (:func:`experiments.validation.noise_floor`), so whatever sets them apart is
    the machine.  An error under it cannot be told from noise; a target under it cannot
    be met by any model.  NaN where a source has no such pair."""
    rows = []
    for (source, model, dtype), part in table.groupby(["source", "model", "dtype"], sort=False):
        # measured_ms is the same under every variant: one variant's rows
        floor = noise_floor(part[part.variant == part.variant.iloc[0]])
        rows.append({"source": source, "model": model, "dtype": dtype,
                     "noise_floor_median_pct": floor[0] if floor else np.nan,
                     "noise_floor_max_pct": floor[1] if floor else np.nan})
    return pd.DataFrame(rows)


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Median and max |error| (%) of iteration time per source, model, dtype and variant,
    the median signed error and |bubble error|, and the source's :func:`noise_floors`."""
    t = table.assign(err=100 * (table.predicted_ms / table.measured_ms - 1),
                     bubble_err=(table.bubble_pred - table.bubble_meas).abs())
    out = t.groupby(["source", "model", "dtype", "variant"], sort=False).agg(
        plans=("err", "size"), median_abs_err_pct=("err", lambda e: e.abs().median()),
        max_abs_err_pct=("err", lambda e: e.abs().max()),
        median_signed_err_pct=("err", "median"),
        median_abs_bubble_err=("bubble_err", "median")).reset_index()
    return out.merge(noise_floors(table), on=["source", "model", "dtype"], how="left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evidence", type=Path, default=EVIDENCE)
    ap.add_argument("--sources",
                    default="traces,grid_2stages,gpu_results,h200_grid,cpu16,cpu16_latest")
    ap.add_argument("--grid", type=Path, action="append", default=[], metavar="DIR",
                    help="a gpu_validate.py --out folder to re-predict too, named by its "
                    "folder (repeatable): a new GPU run's grid without a change here")
    args = ap.parse_args()
    rows: list[dict] = []
    for source in args.sources.split(","):
        rows += {"traces": traces, "grid_2stages": grid_2stages, "gpu_results": grid_gpu_results,
                 "h200_grid": grid_h200, "cpu16": cpu16, "cpu16_latest": cpu16_latest}[source](args.evidence)
    for folder in args.grid:
        if not (folder / "validation_gpu.csv").exists():
            ap.error(f"--grid {folder}: no validation_gpu.csv there (a gpu_validate.py --out "
                     "folder holds it, with its calibration and profiles)")
        rows += _gpu_grid(folder.name, folder)
    table = pd.DataFrame(rows)
    summary = summarise(table)
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    meta = {"evidence": str(args.evidence), "variants": list(VARIANTS)}
    grids = [g for g in (("gpu_results", LATEST_GPU), ("h200_grid", H200_GRID))
             if g[0] in args.sources.split(",")]
    if grids:
        memory = pd.concat([gpu_memory(folder, name) for name, folder in grids],
                           ignore_index=True)
        for col, label in (("peak_pred_bytes_as_run", "as run"), ("peak_pred_bytes", "today")):
            err = 100 * (memory[col] / memory.peak_meas_bytes - 1)
            memory[f"error_{col}_pct"] = err
            for (source, model, dtype), e in err.groupby([memory.source, memory.model,
                                                          memory.dtype]):
                print(f"peak memory {source} {model} {dtype} ({label}): median |error| "
                      f"{e.abs().median():.2f}%, max {e.abs().max():.1f}%")
            print(f"peak memory, all GPU grid plans ({label}): median |error| "
                  f"{err.abs().median():.2f}%, max {err.abs().max():.1f}%")
        write_results("repredict_evidence_memory", memory, meta)
    write_results("repredict_evidence", table, meta)
    write_results("repredict_evidence_summary", summary, meta)


if __name__ == "__main__":
    main()
