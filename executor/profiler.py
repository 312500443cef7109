"""The layer profiler: measure every layer of an ``nn.Sequential`` at several micro-batch sizes.

For each micro-batch size ``b`` the layers are run in order on the real output of the
layers before them (so a layer sees real activations, not random ones), in train mode:

    x_b --layer 0--> y0 --layer 1--> y1 ... --layer L-1--> y_{L-1} --loss--> scalar

Layer ``i`` is timed alone on a detached copy of ``y_{i-1}``: forward, then backward from
a random output gradient (the last layer's forward includes the loss and its backward
starts from the loss, as on a pipeline's last stage).  Times are medians over
``repeats`` after ``warmup`` runs, with CUDA events on GPU (and the host seconds of the
issuing call beside them), and again inside ``torch.utils.checkpoint``.  Bytes come from autograd's
saved-tensor hooks, each storage counted once, parameters excluded; the nodes each
layer's forward adds to the autograd graph are counted from that same forward
(``autograd_nodes``: what orders backwards on a device's autograd thread).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import functools
import itertools
import math
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from executor import split_backward
from executor.host_allocator import retain_freed_memory
from executor.memory import module_bytes, parameter_keys, record_saved_tensors, tensor_bytes
from executor.memtrack import Timeline, Tracker, granularity_of
from executor.skip import SkipTracker, check_skips, use_tracker
from executor.timing import Stopwatch, synchronize
from pipesim.profile import COLUMNS, MAX_CHECKPOINT_SAVING, OPTIONAL_COLUMNS, Profile

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the GPU model, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _detached_input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.is_floating_point():
        x.requires_grad_(True)
    return x


class _MadeGradient(torch.autograd.Function):
    """A root for a layer's backward that hands the layer its output gradient as a new
    tensor (a copy of ``grad``), which autograd frees once the layer's first operation has
    used it -- as inside a stage, where the layer after makes it -- while no variable
    holds the layer's output: it lives as long as the layer saved it, as in a stage (see
    ``bwd_fed_rise_bytes``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _root: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.grad.clone(), None


def _measure_rise(layer: nn.Module, x: torch.Tensor, loss_fn: LossFn | None,
                   target: torch.Tensor | None, grad: torch.Tensor | None,
                   fed: bool = False) -> tuple[float, float]:
    """``(forward temporaries, backward rise)`` of one forward and backward of ``layer``
    under :mod:`executor.memtrack`, in bytes: the forward's peak above what it leaves
    behind, and the backward's peak above where the forward ended.  The output and its
    gradient ``grad`` are held throughout (as a stage's output and received gradient
    are), or with ``fed`` neither: the gradient is handed on as a copy made at the
    backward's start (:class:`_MadeGradient`).  Gradients are present already, as in
    every backward but a stage's first."""
    timeline = Timeline(granularity_of(x.device))
    held = [*layer.parameters(), *layer.buffers(), x, x.grad, target, grad]
    held += [p.grad for p in layer.parameters() if p.grad is not None]
    timeline.add_existing("d", [t for t in held if t is not None])
    with Tracker(timeline, "d"):
        y = layer(x)
        out = loss_fn(y, target) if loss_fn is not None else y
        fwd_transient = timeline.peak["d"] - timeline.level["d"]
        if fed and out.requires_grad:
            out = _MadeGradient.apply(out, grad)
            grad = torch.ones_like(out)  # (the root's, a scalar: made before measuring)
            del y  # (the output lives on only where the layer saved it)
        after = timeline.level["d"]
        timeline.peak["d"] = after  # the backward's own peak from here
        if out.requires_grad:
            _backward(out, grad)
        rise = timeline.peak["d"] - after
        del out
    timeline.forget()
    return float(fwd_transient), float(rise)


def _transients(layer: nn.Module, x: torch.Tensor, loss_fn: LossFn | None,
                target: torch.Tensor | None, grad: torch.Tensor | None,
                row: dict[str, float]) -> dict[str, float]:
    """Bytes a layer holds only while it runs, seen by :mod:`executor.memtrack`.

    ``fwd_transient_bytes``: the forward's peak above what it leaves behind (temporaries).
    ``bwd_rise_bytes``: the backward's peak above where the forward ended, its output
    gradient held throughout (as a stage's received gradient is): its input gradient where
    it makes one, weight gradients being formed, other temporaries; after a loss, the
    output's gradient too.
    ``bwd_fed_rise_bytes``: the same with the output gradient made anew at the backward's
    start and freed once used, as the layer after makes it inside a stage (after a loss,
    which makes its own: ``bwd_rise_bytes``).
    ``bwd_transient_bytes``: ``bwd_rise_bytes`` less the input gradient (and, after a
    loss, the output's gradient) that the simulator counts itself, no less than 0.
    """
    fwd_transient, rise = _measure_rise(layer, x, loss_fn, target, grad)
    fed_rise = (_measure_rise(layer, x, loss_fn, target, grad, fed=True)[1]
                if loss_fn is None and grad is not None else rise)
    counted = (row["input_bytes"] if x.requires_grad else 0) + (
        row["output_bytes"] if loss_fn is not None else 0)
    return {"fwd_transient_bytes": fwd_transient,
            "bwd_transient_bytes": float(max(rise - counted, 0)),
            "bwd_rise_bytes": rise, "bwd_fed_rise_bytes": fed_rise}


def _run_layer(layer: nn.Module, x: torch.Tensor, loss_fn: LossFn | None,
               target: torch.Tensor | None) -> torch.Tensor:
    y = layer(x)
    return loss_fn(y, target) if loss_fn is not None else y


def _backward(y: torch.Tensor, grad: torch.Tensor | None) -> None:
    torch.autograd.backward(y, grad)


def autograd_nodes(out: torch.Tensor) -> int:
    """Nodes of the autograd graph behind ``out`` (its backward functions, not the
    parameters' gradient accumulators): what a forward that made ``out`` from a detached
    input adds to its thread's sequence number, by which autograd's thread for a device
    orders the backwards it runs (the profile's ``autograd_nodes``)."""
    seen: set = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return len(seen)


def profile_layer(layer: nn.Module, x: torch.Tensor, *, loss_fn: LossFn | None = None,
                  target: torch.Tensor | None = None, repeats: int = 5,
                  warmup: int = 2) -> dict[str, Any]:
    """Measure one layer on input ``x``: forward/backward seconds and the byte columns.

    With ``loss_fn``, the forward includes the loss on ``target`` and backward starts from it.
    Returns a dict of the profile columns except layer, name and micro_batch, plus
    ``"output"``: the layer's output (not the loss) for the next layer.
    """
    device = x.device
    x = _detached_input(x)
    # Bytes: one forward under the saved-tensor hooks.
    with record_saved_tensors() as saved:
        y = layer(x)
        out = loss_fn(y, target) if loss_fn is not None else y
    params = parameter_keys(layer)
    saved_bytes = saved.bytes_excluding(params)
    row = {
        "input_bytes": tensor_bytes(x),
        "output_bytes": tensor_bytes(y),
        "saved_bytes": saved_bytes,
        "saved_input_bytes": saved.bytes_of(x),
        "saved_output_bytes": saved.bytes_of(y),
        "param_bytes": module_bytes(layer),
        "autograd_nodes": autograd_nodes(out),
    }
    needs_grad = out.requires_grad
    grad = None if (loss_fn is not None or not needs_grad) else torch.randn_like(out)
    if needs_grad:
        _backward(out, grad)
    del out
    row.update(_transients(layer, x, loss_fn, target, grad, row))
    fwd, bwd = Stopwatch(device), Stopwatch(device)
    for i in range(warmup + repeats):
        timed = i >= warmup
        synchronize(device)
        if timed:
            with fwd.region():
                out = _run_layer(layer, x, loss_fn, target)
        else:
            out = _run_layer(layer, x, loss_fn, target)
        if needs_grad:
            if timed:
                with bwd.region():
                    _backward(out, grad)
            else:
                _backward(out, grad)
        del out
    synchronize(device)
    row["fwd_s"] = statistics.median(fwd.elapsed())
    row["bwd_s"] = statistics.median(bwd.elapsed()) if needs_grad else 0.0
    row["output"] = y.detach()
    return row


def _time_split(layer: nn.Module, x: torch.Tensor, loss_fn: LossFn | None,
                target: torch.Tensor, grad: torch.Tensor | None, device: torch.device
                ) -> dict[str, float]:
    """The backward split as the executor splits it (:mod:`executor.split_backward`):
    ``I`` to the input (keeping the graph), then ``W`` to the weights."""
    params = [p for p in layer.parameters() if p.requires_grad]
    y = layer(x)
    out = loss_fn(y, target) if loss_fn is not None else y
    inputs = [x] if x.requires_grad else []
    i_watch, w_watch = Stopwatch(device), Stopwatch(device)
    synchronize(device)
    with i_watch.region():
        _, work = split_backward.input_grad(out, grad, inputs, params)
    # bytes I leaves for W: gradients it captured, but not the one the layer received
    # (a stage keeps it anyway) nor, after a loss, the logits' (the loss gradient)
    received = grad.untyped_storage().data_ptr() if grad is not None else None
    pending = aliased = 0
    for g in work.held():
        nbytes = g.untyped_storage().nbytes()
        if g.untyped_storage().data_ptr() == received or (
                loss_fn is not None and nbytes == tensor_bytes(y)):
            aliased += nbytes
        else:
            pending += nbytes
    with w_watch.region():
        split_backward.weight_grad(work)
    return {"bwd_input_s": i_watch.elapsed()[0], "bwd_weight_s": w_watch.elapsed()[0],
            "w_pending_bytes": float(pending), "w_received_bytes": float(aliased)}


def _time_pass(layers: list[nn.Module], x: torch.Tensor, loss_fn: LossFn | None,
               target: torch.Tensor, grads: list[torch.Tensor | None],
               device: torch.device, checkpointed: bool, split: bool = False
               ) -> list[dict[str, float]]:
    """One pass over all layers: each layer's forward then its backward, timed alone.

    The first layer's input is data (no gradient), as on a pipeline's first stage.
    Returns per layer the time columns of the profile: device seconds (``fwd_s``,
    ``bwd_s``), host seconds of the issuing calls (``host_*``) and, if ``checkpointed``,
    the same layer run inside ``torch.utils.checkpoint`` as the executor runs a
    checkpointed stage (``ckpt_fwd_s``; ``ckpt_bwd_s`` recomputes, then back-propagates),
    and, if ``split``, the backward's two halves (``bwd_input_s``, ``bwd_weight_s``).
    """
    times = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1 and loss_fn is not None
        x = x.detach()
        if i > 0 and x.is_floating_point():
            x.requires_grad_(True)
        grad = None if last else grads[i]
        fwd, bwd = Stopwatch(device), Stopwatch(device)
        synchronize(device)
        with fwd.region():
            y = layer(x)
            out = loss_fn(y, target) if last and loss_fn is not None else y
        row = {"fwd_s": fwd.elapsed()[0], "host_fwd_s": fwd.host_elapsed()[0],
               "bwd_s": 0.0, "host_bwd_s": 0.0}
        if out.requires_grad:
            with bwd.region():
                _backward(out, grad)
            row.update(bwd_s=bwd.elapsed()[0], host_bwd_s=bwd.host_elapsed()[0])
        if checkpointed:
            cf, cb = Stopwatch(device), Stopwatch(device)
            synchronize(device)
            with cf.region():
                z = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=True)
                out = loss_fn(z, target) if last and loss_fn is not None else z
            row["ckpt_fwd_s"], row["ckpt_bwd_s"] = cf.elapsed()[0], 0.0
            if out.requires_grad:
                with cb.region():
                    _backward(out, grad)
                row["ckpt_bwd_s"] = cb.elapsed()[0]
        if split:
            row.update(_time_split(layer, x, loss_fn if last else None, target, grad, device)
                       if out.requires_grad else {"bwd_input_s": 0.0, "bwd_weight_s": 0.0,
                                                  "w_pending_bytes": 0.0,
                                                  "w_received_bytes": 0.0})
        times.append(row)
        x = y
    return times


def _time_whole_split(model: nn.Sequential, x: torch.Tensor, loss_fn: LossFn | None,
                      target: torch.Tensor, device: torch.device) -> tuple[float]:
    """Seconds of the whole model's split backward, I and W together (its input is data:
    I only walks the graph, W does the rest); the per-layer splits summed exceed it by
    the graph walks and calls a stage pays once."""
    out = model(x.detach())
    if loss_fn is not None:
        out = loss_fn(out, target)
    grad = None if loss_fn is not None else torch.randn_like(out)
    watch = Stopwatch(device)
    synchronize(device)
    with watch.region():
        _, work = split_backward.input_grad(out, grad, [], [p for p in model.parameters()
                                                            if p.requires_grad])
        split_backward.weight_grad(work)
    return (watch.elapsed()[0],)


def _time_whole(model: nn.Sequential, x: torch.Tensor, loss_fn: LossFn | None,
                target: torch.Tensor, grad: torch.Tensor | None,
                device: torch.device, checkpointed: bool = False) -> tuple[float, float]:
    """Forward and backward seconds of the whole model on ``x`` (data: no input gradient);
    with ``checkpointed``, the model run as one ``torch.utils.checkpoint`` call."""
    fwd, bwd = Stopwatch(device), Stopwatch(device)
    synchronize(device)
    with fwd.region():
        if checkpointed:
            out = checkpoint(model, x.detach(), use_reentrant=False, preserve_rng_state=True)
        else:
            out = model(x.detach())
        if loss_fn is not None:
            out = loss_fn(out, target)
    with bwd.region():
        _backward(out, None if loss_fn is not None else torch.randn_like(out))
    return fwd.elapsed()[0], bwd.elapsed()[0]


def _checkpoint_whole(model: nn.Sequential, x: torch.Tensor, loss_fn: LossFn | None,
                      target: torch.Tensor, grad: torch.Tensor | None,
                      device: torch.device) -> tuple[float, float]:
    """What running the whole model as one ``torch.utils.checkpoint`` call adds, ``(forward
    s, backward s)``: the checkpointed pass against the plain pass timed again right after
    it, so that both come after a whole pass of the model (the profile adds the medians
    of these to the plain pass's, ``whole_model[size]["ckpt_fwd_s"/"ckpt_bwd_s"]``).
    The plain pass :func:`_time_whole` timed first comes right after the layer-by-layer
    pass, the caches holding other work: on this project's CPU it ran 0.15-0.23 ms slower
    than the same pass timed again for the MLP (8 layers), so the checkpoint read as
    costing 0.10-0.15 ms instead of the 0.26-0.32 ms it costs against the second
    (2026-11-26, 25 passes at 2-32 samples; stages of it timed directly, alternating: 0.08
    ms for one layer, 0.16-0.25 ms for four), and the span costs took the difference for
    the checkpoint's entry paid once a call (:meth:`pipesim.Profile.isolation_excess`)."""
    ckpt_f, ckpt_b = _time_whole(model, x, loss_fn, target, grad, device, True)
    again_f, again_b = _time_whole(model, x, loss_fn, target, grad, device)
    return ckpt_f - again_f, ckpt_b - again_f - again_b


def _time_whole_repeated(model: nn.Sequential, x: torch.Tensor, loss_fn: LossFn | None,
                         target: torch.Tensor, device: torch.device,
                         runs: int = 3) -> tuple[float, float]:
    """Seconds of the whole model's forward right after another forward, and of its
    backward right after another backward (medians over ``runs - 1``): ``runs`` forwards
    back to back, then their backwards, as a GPipe stage runs its micro-batches.  Against
    :func:`_time_whole` (a forward after a backward, as in a 1F1B stage's steady state)
    they say what an action costs when the one before it on the core was the same: its
    weights and code still in the caches."""
    outs, fwd = [], []
    synchronize(device)
    for _ in range(runs):
        watch = Stopwatch(device)
        with watch.region():
            out = model(x.detach())
            if loss_fn is not None:
                out = loss_fn(out, target)
        fwd.append(watch.elapsed()[0])
        outs.append(out)
    bwd = []
    for out in outs:
        watch = Stopwatch(device)
        with watch.region():
            _backward(out, None if loss_fn is not None else torch.randn_like(out))
        bwd.append(watch.elapsed()[0])
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _noisy(layer: int, size: int, reps: list[tuple[float, float]]) -> list[dict]:
    """Flags for a layer's repetitions whose spread (inter-quartile range) exceeds half
    their median: a burst of load landed on them."""
    out = []
    for k, what in enumerate(("fwd_s", "bwd_s")):
        values = sorted(r[k] for r in reps)
        if len(values) < 3 or values[len(values) // 2] <= 0:
            continue
        q1, q3 = values[len(values) // 4], values[(3 * len(values)) // 4]
        med = values[len(values) // 2]
        if q3 - q1 > 0.5 * med and q3 - q1 > 20e-6:
            out.append({"layer": layer, "micro_batch": size, "column": what,
                        "why": f"repetitions spread {q1 * 1e3:.3f}-{q3 * 1e3:.3f} ms around "
                               f"{med * 1e3:.3f} ms"})
    return out


def _implausible_saving(times: dict[str, float], size: int) -> list[dict]:
    """Flags, and corrects in ``times`` (the whole model's seconds at ``size`` samples), a
    checkpointed pass that reads a saving beyond :data:`pipesim.profile.MAX_CHECKPOINT_SAVING`
    of the plain forward: it is noise, not the checkpoint, and reads as no saving at all
    (the plain pass's seconds).  A checkpointed pass is the plain pass plus the median of
    what the checkpoint added against a second plain pass: on a tiny model with a single
    repetition on a busy machine that came to -0.08 ms, a forward in negative seconds."""
    forward = times["fwd_s"]
    plain = {"ckpt_fwd_s": forward, "ckpt_bwd_s": forward + times["bwd_s"]}
    out = []
    for key, seconds in plain.items():
        if times[key] < seconds - MAX_CHECKPOINT_SAVING * forward:
            out.append({"layer": "whole model", "micro_batch": size, "column": key,
                        "why": f"{times[key] * 1e3:.3f} ms checkpointed against "
                               f"{seconds * 1e3:.3f} ms plain: read as no saving"})
            times[key] = seconds
    return out


def _not_monotone(rows: list[dict]) -> list[dict]:
    """Flags where a layer takes over twice as long on fewer samples than on more."""
    out = []
    by_layer: dict[int, list[dict]] = {}
    for r in rows:
        by_layer.setdefault(r["layer"], []).append(r)
    for layer, rs in by_layer.items():
        rs.sort(key=lambda r: r["micro_batch"])
        for a, b in itertools.pairwise(rs):
            for what in ("fwd_s", "bwd_s"):
                if a[what] > 2 * b[what] and a[what] - b[what] > 50e-6:
                    out.append({"layer": layer, "micro_batch": a["micro_batch"], "column": what,
                                "why": f"{a[what] * 1e3:.3f} ms at {a['micro_batch']} samples, "
                                       f"{b[what] * 1e3:.3f} ms at {b['micro_batch']}"})
    return out


def profile(model: nn.Sequential, sample_batch: tuple[torch.Tensor, torch.Tensor],
            micro_batch_sizes: Sequence[int], device: str | torch.device = "cpu", *,
            loss_fn: LossFn | None = None, repeats: int = 5, warmup: int = 2,
            dtype: torch.dtype | None = None, progress: bool = True,
            checkpointed: bool = True, split: bool = True, streams: int = 0,
            interpreter: bool = False, pairs: bool = False, repeated: bool = False,
            meta: dict | None = None) -> Profile:
    """Profile every layer of ``model`` at each size in ``micro_batch_sizes``.

    ``sample_batch`` is ``(inputs, targets)`` with at least ``max(micro_batch_sizes)``
    samples; the first ``b`` rows make the micro-batch of size ``b``.  The model is moved
    to ``device`` (and ``dtype`` if given) and put in train mode.

    Repetitions are whole passes over the layers rather than back-to-back runs of one
    layer, and they go round the sizes (a pass at each size, then the next round): on a
    shared, noisy machine a burst of load then spreads over every layer's and every size's
    samples instead of inflating one layer's or one size's median.  ``checkpointed`` also times every
    layer inside ``torch.utils.checkpoint`` (the optional ``ckpt_*`` columns; about 1.6x
    the profiling time, two more whole-model passes a repetition included), since a
    checkpointed stage pays the checkpoint's hooks, which launch-bound layers feel most.
    ``split`` also times each backward's input and weight halves (``bwd_input_s``,
    ``bwd_weight_s``) for the zero-bubble schedules.  ``streams``
    (> 1) also measures, at each size, how ``1..streams`` worker threads share the device
    (:func:`measure_device_speedup`, ``meta["stream_speedup"]``): what the simulator needs
    for pipeline stages placed on one GPU.  ``interpreter`` also measures, at each size, the
    share of each pass (forward, backward, and both checkpointed) that holds the
    interpreter and its slowdown there while contended (:func:`measure_interpreter_share`,
    ``meta["interpreter_share"]``, ``meta["interpreter_slowdown"]``): what the simulator
    needs for stages that are threads of one process.  ``pairs`` also measures, at each
    size, how much longer each of those passes takes while another thread runs each of
    them (:func:`measure_pair_slowdown`, ``meta["pair_slowdown"]``; 16 pairs, on a GPU
    some 5-15 s a size): what :attr:`pipesim.cluster.Cluster.thread_pairs` predicts
    with.  ``repeated`` also times the whole
    model's forwards back to back and backwards back to back (:func:`_time_whole_repeated`,
    ``whole_model[size]["fwd_repeat_s"/"bwd_repeat_s"]``, read by
    :meth:`pipesim.Profile.repeat_factor`; a measurement the simulator does not apply, and
    half again the profiling time).  Returns a :class:`pipesim.Profile`;
    ``meta`` adds to its metadata.  Sets this process's host allocator policy
    (:func:`executor.host_allocator.retain_freed_memory`), as the pipelines do.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"profile needs an nn.Sequential, got {type(model).__name__}")
    sizes = sorted({int(b) for b in micro_batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"micro-batch sizes must be positive integers, got {list(micro_batch_sizes)}")
    inputs, targets = sample_batch
    if inputs.shape[0] < sizes[-1]:
        raise ValueError(f"sample batch has {inputs.shape[0]} samples, fewer than the largest "
                         f"micro-batch size {sizes[-1]}")
    device = torch.device(device)
    # the host allocator the runs use (executor.host_allocator), before any tensor is made
    allocator = retain_freed_memory()
    model.to(device=device, dtype=dtype).train()
    layers = list(model)
    rows = []
    noisy: list[dict] = []
    whole_model: dict[str, dict[str, float]] = {}
    routes = check_skips(model)
    skips: list[dict[str, Any]] = [{"name": r.name, "stash_layer": r.src, "pop_layer": r.dst,
                                    "bytes": {}} for r in routes]
    bar = tqdm(total=len(sizes) * (1 + warmup + repeats), desc="profiling",
               disable=None if progress else True,  # (None: off where stderr is no terminal)
               unit="pass", leave=False)
    # Layers run one at a time and repeatedly: a retaining tracker lets a Pop layer find
    # the tensor its Stash layer left, every time.
    with use_tracker(SkipTracker(retain=True)):
        prepared = {}
        for b in sizes:
            # clone: a view of the whole batch would report the whole batch's storage.
            x0 = inputs[:b].clone().to(device)
            if dtype is not None and x0.is_floating_point():
                x0 = x0.to(dtype)
            target = targets[:b].clone().to(device)
            # Bytes, output gradients and a first warm-up: one layer at a time.
            x, grads, byte_rows = x0, [], []
            for i, layer in enumerate(layers):
                last = i == len(layers) - 1 and loss_fn is not None
                row = profile_layer(layer, x, loss_fn=loss_fn if last else None,
                                    target=target if last else None, repeats=1, warmup=0)
                x = row.pop("output")
                grads.append(None if last else torch.randn_like(x) if x.is_floating_point() else None)
                byte_rows.append(row)
            bar.update(1)
            if skips:  # bytes of each skip tensor at this size
                with torch.no_grad(), use_tracker(SkipTracker(retain=True)) as tracker:
                    model(x0)
                for skip in skips:
                    skip["bytes"][str(b)] = tensor_bytes(tracker.stashed[skip["name"]])
            prepared[b] = (x0, target, grads, byte_rows)
        # Repetitions go round the sizes (one pass of each size, then the next round): a
        # slow spell of a shared machine then lands on every size a little instead of on
        # one size whole, which would bend the size scaling the costs interpolate.
        samples: dict[int, list[list[dict[str, float]]]] = {b: [] for b in sizes}
        whole: dict[int, list[tuple[float, ...]]] = {b: [] for b in sizes}
        for p in range(warmup + repeats):
            for b in sizes:
                x0, target, grads, _ = prepared[b]
                times = _time_pass(layers, x0, loss_fn, target, grads, device, checkpointed,
                                   split)
                w: tuple[float, ...] = _time_whole(model, x0, loss_fn, target, grads[-1], device)
                if checkpointed:
                    w += _checkpoint_whole(model, x0, loss_fn, target, grads[-1], device)
                if split:
                    w += _time_whole_split(model, x0, loss_fn, target, device)
                if repeated:
                    w += _time_whole_repeated(model, x0, loss_fn, target, device)
                if p >= warmup:
                    samples[b].append(times)
                    whole[b].append(w)
                bar.update(1)
        keys = ("fwd_s", "bwd_s") + (("ckpt_fwd_s", "ckpt_bwd_s") if checkpointed else ()) + (
            ("split_s",) if split else ()) + (("fwd_repeat_s", "bwd_repeat_s") if repeated else ())
        for b in sizes:
            byte_rows = prepared[b][3]
            whole_model[str(b)] = {k: statistics.median(t[i] for t in whole[b])
                                   for i, k in enumerate(keys)}
            if checkpointed:  # the medians of what the checkpoint adds, on the plain pass's
                medians = whole_model[str(b)]
                medians["ckpt_fwd_s"] += medians["fwd_s"]
                medians["ckpt_bwd_s"] += medians["fwd_s"] + medians["bwd_s"]
                noisy += _implausible_saving(medians, b)
            for i, layer in enumerate(layers):
                row = byte_rows[i]
                for column in samples[b][0][i]:
                    row[column] = statistics.median(t[i][column] for t in samples[b])
                rows.append({"layer": i, "name": type(layer).__name__, "micro_batch": b, **row})
                noisy += _noisy(i, b, [(t[i]["fwd_s"], t[i]["bwd_s"]) for t in samples[b]])
    bar.close()
    model.zero_grad(set_to_none=True)
    noisy += _not_monotone(rows)
    if noisy:
        warnings.warn(f"profile: {len(noisy)} noisy measurement(s), e.g. {noisy[0]}; the machine "
                      "was probably busy: profile again on a quiet machine or with more "
                      "--repeats (all listed in the profile's metadata, 'noisy')", stacklevel=2)
    table = pd.DataFrame(rows)
    table = table[list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in table.columns]]
    info: dict[str, Any] = {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype or next(model.parameters()).dtype).replace("torch.", ""),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "host_allocator": allocator,
        "repeats": repeats,
        "warmup": warmup,
        "repetition": "passes over all layers, round the sizes",
        # the whole model's forward/backward at each size, timed in the same passes: the
        # Profile uses it to remove the cost of timing layers one by one (see Profile)
        "whole_model": whole_model,
        # skip connections: stashing and popping layer, bytes per micro-batch size
        "skips": skips,
        "loss_in_last_layer": loss_fn is not None,
        # measurements to distrust: repetitions that disagree, or a smaller size slower
        # than a larger one (see _noisy, _not_monotone)
        "noisy": noisy,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }
    law: dict[str, list[float]] = {}
    shares: dict[str, dict[str, float]] = {}
    slowdowns: dict[str, dict[str, float]] = {}
    engine_shares: dict[str, dict[str, float]] = {}
    pair_ratios: dict[str, dict[str, float]] = {}
    for b in sizes if streams > 1 or interpreter or pairs else ():
        x0 = inputs[:b].to(device)
        if dtype is not None and x0.is_floating_point():
            x0 = x0.to(dtype)
        y0 = targets[:b].to(device)
        if streams > 1:
            law[str(b)] = measure_device_speedup(model, loss_fn or _sum_loss, x0, y0, device,
                                                 streams)
        if interpreter:
            shares[str(b)], slowdowns[str(b)] = measure_interpreter_share(
                model, loss_fn or _sum_loss, x0, y0, device)
            if device.type != "cpu":  # a CPU's backward runs on its caller's thread
                hooks = measure_engine_interpreter_share(model, loss_fn or _sum_loss, x0, y0,
                                                         device, shares[str(b)])
                if hooks is not None:
                    engine_shares[str(b)] = hooks
        if pairs:
            pair_ratios[str(b)] = measure_pair_slowdown(model, loss_fn or _sum_loss, x0, y0,
                                                        device)
    if law:
        info["stream_speedup"] = law
    if shares:
        info["interpreter_share"] = shares
        info["interpreter_slowdown"] = slowdowns
    if engine_shares:
        info["engine_interpreter_share"] = engine_shares
    if pair_ratios:
        info["pair_slowdown"] = pair_ratios
    info.update(meta or {})
    return Profile(table=table, meta=info)


def _sum_loss(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    """A stand-in loss where the model has none: the backward of ``out.sum()``."""
    return out.float().sum()


#: the side streams the concurrency measurements issue to, one per thread index and
#: device, made once: the CUDA libraries cache a workspace for every stream that runs a
#: matmul and never free it (about 99 MiB a stream on an H100: the 2026-11-23 grid's
#: snapshots hold some 25 such streams, 2.5 GB, from streams made per measurement)
_STREAMS: dict[tuple[str, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    key = (str(device), index)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


def _threads_wall(steps: Sequence[Callable[[], object]], device: torch.device,
                  iterations: int, background: Callable[[], object] | None = None) -> float:
    """Wall seconds of ``len(steps)`` threads, each with its own stream on a GPU, running
    its step ``iterations`` times, started together (each thread's first step is set-up),
    until the last has run them and its stream has done their work; with ``background``,
    one more thread runs that over and over until they are done (its queued work not
    waited for)."""
    # (a thread that fails before the start breaks the barrier for the others: no hang)
    start, done = threading.Barrier(len(steps) + 2 if background else len(steps) + 1,
                                    timeout=600), threading.Event()

    def work(index: int, step: Callable[[], object], count: int | None) -> None:
        stream = _side_stream(device, index) if device.type == "cuda" else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            step()
            synchronize(device)
            start.wait()
            if count is None:
                while not done.is_set():
                    step()
            else:
                for _ in range(count):
                    step()
            # its own stream's work only: a device-wide synchronise would also wait for
            # what the background thread has queued on its stream (on a device-bound pass
            # the host runs many kernels ahead), timing the other thread's work as this one's
            if stream is not None:
                stream.synchronize()
            else:
                synchronize(device)

    timed = [threading.Thread(target=work, args=(i, step, iterations), daemon=True)
             for i, step in enumerate(steps)]
    behind = ([threading.Thread(target=work, args=(len(steps), background, None), daemon=True)]
              if background else [])
    for t in timed + behind:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in timed:
        t.join(timeout=600)
    wall = time.perf_counter() - t0
    done.set()
    for t in behind:
        t.join(timeout=600)
    return wall


def hook_share(plain_ratio: float, checkpointed_ratio: float, recompute_share: float,
               forward_share: float, recompute_hold: float) -> float | None:
    """The share of a checkpointed backward proper's seconds that holds the interpreter,
    from each backward run beside another thread's forwards against alone (the ratios).

    A pass that holds the interpreter ``h`` of its time beside forwards that hold it
    ``g`` of theirs slows by ``1 + h g`` (its held part waits for the lock half the time
    the forwards hold it).  Beside the same forwards a plain backward slows by
    ``plain_ratio`` (its device shared, its C++ outside the interpreter); what a
    checkpointed one loses over that is its recomputation's hold (``recompute_share`` of
    its seconds, holding ``recompute_hold`` of them) and its hooks' (the rest, ``h``)::

        checkpointed_ratio / plain_ratio - 1 = rho r g + (1 - rho) h g

    Returns ``h`` clamped to [0, 1]; None where the forwards hold too little of the
    interpreter (``g < 0.2``) for the difference to tell."""
    if forward_share < 0.2 or plain_ratio <= 0 or recompute_share >= 1:
        return None
    extra = checkpointed_ratio / plain_ratio - 1 - recompute_share * recompute_hold * forward_share
    return min(max(extra / ((1 - recompute_share) * forward_share), 0.0), 1.0)


def measure_engine_interpreter_share(module: torch.nn.Module, loss_fn, x: torch.Tensor,
                                     y: torch.Tensor, device: str | torch.device,
                                     shares: dict[str, float], iterations: int = 10,
                                     trials: int = 3, min_seconds: float = 0.05
                                     ) -> dict[str, float] | None:
    """``meta["engine_interpreter_share"]`` at one size: ``{"B": 0, "Bc": h}``.

    On an accelerator autograd's thread issues a backward in C++, outside the interpreter
    (``B``: 0, assumed) -- but for torch.utils.checkpoint's unpack hooks, Python run for
    each saved tensor the backward reads.  A plain and a checkpointed backward are each
    timed alone and beside another thread running forwards over and over (a pipeline's
    other stage), and :func:`hook_share` reads ``h`` off the two slowdowns, with the
    forward's and the checkpointed forward's interpreter shares ``shares`` (from
    :func:`measure_interpreter_share`) for the forwards' and the recomputation's holds.
    None where the forwards hold too little of the interpreter to tell."""
    dev = torch.device(device)
    passes = _passes(module, loss_fn, x, y, dev, 2)  # mine, then the other thread's
    forward = passes["F"][1]
    ratios, alone = [], []
    for step in (passes["B"][0], passes["Bc"][0]):
        n = _repetitions(step, dev, iterations, min_seconds)
        walls = _side_by_side(step, forward, dev, n, trials)
        alone.append(statistics.median(a for _, a in walls) / n)
        ratios.append(statistics.median(b / a for b, a in walls))
    # the recomputation's share of the checkpointed backward: what it costs over a plain one
    recompute_share = min(max(1 - alone[0] / alone[1], 0.0), 0.95)
    h = hook_share(ratios[0], ratios[1], recompute_share, shares["F"],
                   shares.get("Fc", shares["F"]))
    return None if h is None else {"B": 0.0, "Bc": h}


def measure_device_speedup(module: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                           device: str | torch.device = "cuda:0", streams: int = 2,
                           iterations: int = 20) -> list[float]:
    """Aggregate speedup of ``k`` streams running ``module``'s forward+backward together on
    one device, k = 1..streams: the concurrency law of :func:`pipesim.contention.device_law`
    measured directly (one thread and one stream per replica, as pipesim's workers run),
    to set against the law a profile implies.  ``speedup[k-1] = k * alone / together``
    from wall seconds of ``iterations`` steps, clamped to [1, k].
    """
    dev = torch.device(device)
    xs, ys = x.to(dev), y.to(dev)
    steps = []
    for _ in range(streams):
        replica = copy.deepcopy(module).to(dev)
        steps.append(lambda r=replica: loss_fn(r(xs), ys).backward())
    alone = _threads_wall(steps[:1], dev, iterations)
    return [min(max(k * alone / _threads_wall(steps[:k], dev, iterations), 1.0), float(k))
            for k in range(1, streams + 1)]


def measure_interpreter_share(module: torch.nn.Module, loss_fn, x: torch.Tensor,
                              y: torch.Tensor, device: str | torch.device = "cpu",
                              iterations: int = 20, trials: int = 3,
                              min_seconds: float = 0.05
                              ) -> tuple[dict[str, float], dict[str, float]]:
    """``(shares, slowdowns)``: the share of each pass that holds the interpreter, and how
    much slower than its turn it runs there while contended, from two threads running it
    together against one alone (each with its own replica, on a GPU its own stream); per
    pass ``F`` (forward), ``B`` (backward), ``Fc`` (forward inside torch.utils.checkpoint)
    and ``Bc`` (its backward, recomputing): ``meta["interpreter_share"]`` and
    ``meta["interpreter_slowdown"]`` at one size.

    Two passes of ``T`` seconds that each hold the interpreter ``g T`` and overlap fully
    take ``max(T, 2 g T)`` (pipesim.contention.interpreter_law), so ``g = ratio / 2``,
    clamped to [0, 1] (a ratio at or under 1 leaves ``g`` at most 1/2: it reads 1/2 there);
    a ratio over 2 is a pass held wholly that also loses time waiting for the lock, by
    ``ratio / 2`` (the slowdown, 1 otherwise).
    The backward is timed on a graph built once (``retain_graph``): autograd's engine
    runs it outside the interpreter, the forward is Python issuing operations.  On a GPU
    both threads' backwards go to the engine's one thread for the device, so ``B`` and
    ``Bc`` there read its turns (the simulator holds them on that thread,
    :attr:`pipesim.cluster.Device.engine`, not on the interpreter).  The
    checkpointed passes run the checkpoint's Python hooks on every saved tensor, and the
    recomputation is a forward run from the engine: on this project's CPU two checkpointed
    forwards together took 2.6-3.5x one alone (plain ones 1.8-2.0x).
    """
    dev = torch.device(device)
    passes = _passes(module, loss_fn, x, y, dev, 2)
    shares, slowdowns = {}, {}
    for kind, steps in passes.items():
        # the median of three pairs side by side: one stall of a shared machine inside a
        # single pair would read as a lock many times slower
        n = _repetitions(steps[0], dev, iterations, min_seconds)
        ratio = statistics.median(
            _threads_wall(steps, dev, n) / _threads_wall(steps[:1], dev, n)
            for _ in range(trials))
        shares[kind] = min(max(ratio / 2, 0.0), 1.0)
        slowdowns[kind] = max(ratio / 2, 1.0)
    return shares, slowdowns


def _repetitions(step: Callable[[], object], device: torch.device, least: int,
                 min_seconds: float) -> int:
    """How many times to run ``step`` in a timing: at least ``least`` and ``min_seconds``
    of it (a tiny pass 20 times is mostly the threads' start), at most 2000."""
    once = _threads_wall([step], device, 5) / 5
    return int(min(2000, max(least, math.ceil(min_seconds / max(once, 1e-6)))))


def _side_by_side(step: Callable[[], object], background: Callable[[], object],
                  device: torch.device, n: int, trials: int) -> list[tuple[float, float]]:
    """``trials`` pairs of wall seconds of ``n`` runs of ``step``: beside a thread running
    ``background`` over and over, then alone -- each pair side by side, so that a stall of
    a shared machine weighs on one pair of the ``trials``."""
    return [(_threads_wall([step], device, n, background=background),
             _threads_wall([step], device, n)) for _ in range(trials)]


def _passes(module: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
            device: torch.device, replicas: int) -> dict[str, list[Callable[[], object]]]:
    """Per pass ``F``, ``B``, ``Fc``, ``Bc`` (see :func:`measure_interpreter_share`), one
    callable per replica of ``module`` on ``device``: a thread each."""
    xs, ys = x.to(device), y.to(device)
    passes: dict[str, list[Callable[[], object]]] = {"F": [], "B": [], "Fc": [], "Bc": []}
    for _ in range(replicas):
        replica = copy.deepcopy(module).to(device)
        passes["F"].append(functools.partial(replica, xs))
        passes["Fc"].append(functools.partial(checkpoint, replica, xs, use_reentrant=False))
        loss = loss_fn(replica(xs), ys)
        passes["B"].append(functools.partial(loss.backward, retain_graph=True))
        recomputing = loss_fn(checkpoint(replica, xs, use_reentrant=False), ys)
        passes["Bc"].append(functools.partial(recomputing.backward, retain_graph=True))
    return passes


def measure_pair_slowdown(module: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                          device: str | torch.device = "cpu", iterations: int = 10,
                          trials: int = 3, min_seconds: float = 0.05) -> dict[str, float]:
    """``meta["pair_slowdown"]`` at one size: ``{"X|Y": ratio}`` for X, Y in ``F``, ``B``,
    ``Fc``, ``Bc`` -- pass X's wall seconds while a second thread runs pass Y over and
    over (its own replica; on a GPU its own stream), over X's alone, the median of
    ``trials`` pairs timed side by side.

    Two pipeline stages that are threads of one process meet as these pairs do: they
    share the device (the streams' kernels run together), the interpreter (the forwards'
    Python, the checkpoint's hooks) and, on an accelerator, autograd's thread for the
    device (both threads' backwards are issued there).  A pass's share of the interpreter
    (:func:`measure_interpreter_share`) says how long it holds the lock, not who waits:
    beside a forward that holds it in long stretches, a pass that needs it in many short
    ones (a checkpointed backward's recomputation and hooks, run from autograd's thread)
    waits at each -- the H200's 2-sample grid plans lost 1.35 s a second beside forwards
    that way, 0.48 beside another checkpointed backward (``experiments/
    interference_by_kind.py``).  Measured as pairs, each direction is its own figure::

        X alone            |=====X=====|
        X beside Y         |==X==.....==X==.....==X==|     ratio "X|Y" = 2.3
        Y (background)     |=Y=|=Y=|=Y=|=Y=|=Y=|=Y=|=Y=|
    """
    dev = torch.device(device)
    passes = _passes(module, loss_fn, x, y, dev, 2)
    ratios: dict[str, float] = {}
    for kind, (mine, _) in passes.items():
        n = _repetitions(mine, dev, iterations, min_seconds)
        for other, (_, theirs) in passes.items():
            ratios[f"{kind}|{other}"] = statistics.median(
                b / a for b, a in _side_by_side(mine, theirs, dev, n, trials))
    return ratios


def time_whole_model(model: nn.Sequential, batch: tuple[torch.Tensor, torch.Tensor],
                     loss_fn: LossFn, *, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of one forward+backward of the whole model (with the loss) on ``batch``.

    The reference against which the sum of per-layer times is judged (profiler fidelity).
    """
    device = next(model.parameters()).device
    x, t = batch[0].to(device), batch[1].to(device)
    dtype = next(model.parameters()).dtype
    if x.is_floating_point():
        x = x.to(dtype)
    times = [sum(_time_whole(model, x, loss_fn, t, None, device))
             for _ in range(warmup + repeats)]
    model.zero_grad(set_to_none=True)
    return statistics.median(times[warmup:])
