"""The Profile: per-layer costs measured at several micro-batch sizes.

A Profile is a table with one row per (layer, micro-batch size) plus a metadata dict.
It is written by ``executor.profiler.profile`` and read by the simulator and tuner; it
never needs torch.

Columns (units):

=================== ======= =====================================================
``layer``           int     index of the layer in the ``nn.Sequential`` (0-based)
``name``            str     the layer's class name (informative)
``micro_batch``     int     samples in the micro-batch
``fwd_s``           float   forward seconds (median of repetitions)
``bwd_s``           float   backward seconds (median of repetitions)
``input_bytes``     int     bytes of the layer's input tensor(s)
``output_bytes``    int     bytes of the layer's output (crosses a stage boundary)
``saved_bytes``     int     bytes saved for backward, each storage counted once,
                            parameters excluded, input/output included if saved
``saved_input_bytes``  int  the part of ``saved_bytes`` that is the input
``saved_output_bytes`` int  the part of ``saved_bytes`` that is the output
``param_bytes``     int     bytes of the layer's parameters (and buffers)
=================== ======= =====================================================

Optional columns (profiles without them still load; the simulator then falls back):

=================== ======= =====================================================
``host_fwd_s``      float   seconds the host spent issuing the forward (no synchronise);
``host_bwd_s``      float   ... the backward.  On CPU they equal ``fwd_s``/``bwd_s``; on a
                            GPU a layer whose host time reaches its device time is
                            launch-bound (its device time then includes the launch gaps)
``ckpt_fwd_s``      float   forward seconds inside ``torch.utils.checkpoint`` (its hooks
                            and random-state bookkeeping included)
``ckpt_bwd_s``      float   backward seconds of a checkpointed forward: recomputation,
                            then the backward
``bwd_input_s``     float   seconds of the backward's input-gradient half alone (``I``:
                            ``autograd.grad`` to the layer's input)
``bwd_weight_s``    float   seconds of its weight-gradient half (``W``), run after ``I``
                            from the output gradients ``I`` kept; without these columns
                            a layer with parameters splits ``bwd_s`` in equal halves (a
                            matmul's two gradients cost the same) and one without has no W
``w_pending_bytes`` int     bytes ``I`` leaves for ``W``: the gradients it captured inside
                            the layer (not the one it received, nor a loss's logits')
``w_received_bytes`` int    bytes of the received gradient that ``I`` keeps for ``W``
                            (the layer's last operation has weights): inside a stage, an
                            inner layer's such gradient stays too
``fwd_transient_bytes`` int bytes the forward holds only while it runs (temporaries)
``bwd_transient_bytes`` int bytes the backward holds only while it runs, beyond the input
                            gradient: weight gradients being formed, temporaries
``bwd_rise_bytes``  int     the backward's peak above the forward's end, its output
                            gradient held throughout: the input gradient it makes, its
                            temporaries (and, on the loss layer, the logits' gradient)
``bwd_fed_rise_bytes`` int  the same with its output gradient made anew as it starts and
                            freed once used, as the layer after makes it in a stage
``autograd_nodes``  int     nodes the layer's forward adds to the autograd graph (the
                            loss's too, on the last layer; parameters' gradient
                            accumulators not counted): how far it advances its thread's
                            sequence number, which orders autograd's work (see
                            :meth:`Profile.autograd_nodes`)
=================== ======= =====================================================

On disk a Profile is ``NAME.csv`` (the table) beside ``NAME.json`` (the metadata), both
readable without pipesim.  Loading validates everything and fixes nothing.

Workers whose streams share one device run their kernels side by side; how much that
gains depends on the model's kernels at the micro-batch size.  Where the profiler measured
it (``executor.profiler.profile(..., streams=k)`` on a GPU), ``meta["stream_speedup"]``
maps a micro-batch size to ``[1, s_2, ..., s_k]``: ``j`` threads, each with its own stream,
running the model's forward+backward together finish ``s_j`` times the work of one
(host issue included: the threads share one interpreter).  :meth:`Profile.stream_speedup`
reads it; :meth:`pipesim.costs.PlanCosts.device_speedup` prefers it to the law the
profile's size scaling implies.

Workers that are threads of one process hold its interpreter one at a time.  Where the
profiler measured it (``profile(..., interpreter=True)``), ``meta["interpreter_share"]``
maps a micro-batch size to ``{"F": g, "B": g[, "Fc": g, "Bc": g]}``: the share of a
forward's, a backward's (and a checkpointed micro-batch's forward and recomputing
backward) seconds its thread holds the interpreter, read off two threads running the
pass together against one alone.  :meth:`Profile.interpreter_share` and
:meth:`Profile.checkpointed_interpreter_share` read it.  Two passes that hold it wholly
take twice one alone if they simply take turns; a pass whose Python is cut into many
short sections (the checkpoint's hooks) takes longer still, each section waiting for the
lock anew: ``meta["interpreter_slowdown"]`` (same shape, values >= 1: half the measured
ratio where it exceeds 2) is that extra factor, :meth:`Profile.interpreter_slowdown`.
On an accelerator autograd's device thread issues the backwards, outside the interpreter
-- but for torch.utils.checkpoint's unpack hooks, Python run for every saved tensor the
backward reads: ``meta["engine_interpreter_share"]`` maps a size to ``{"B": h, "Bc":
h}``, the share of a plain / checkpointed backward's seconds there that holds the
interpreter too, read off that backward run beside another thread's forwards
(:meth:`Profile.engine_interpreter_share`; 0 where not measured)::

    worker 0   F F F F F F F F            its forwards hold the interpreter
    engine     B(c): |==h==|....|==h==|   each hook waits for its turn

Shares hold where passes simply take turns; beside each other two threads' passes need
not (a pass that holds the interpreter in long stretches starves one that needs it in
many short ones).  Where the profiler measured it (``profile(..., pairs=True)``),
``meta["pair_slowdown"]`` maps a size to ``{"X|Y": ratio}`` for every pair of ``F``,
``B``, ``Fc``, ``Bc``: pass X timed while another thread runs pass Y over and over,
against X alone (each thread with its replica and, on a GPU, its stream: the device,
the interpreter and autograd's thread shared as a pipeline's stage threads share them).
:meth:`Profile.pair_slowdown` reads it; :attr:`pipesim.cluster.Cluster.thread_pairs`
predicts with it.

Timing layers one at a time costs something a stage does not pay (each layer's own
autograd call, cold caches between layers): summed, per-layer times exceed the measured
whole model by a few percent to ~15% on a CPU.  When the metadata holds the whole
model's times (``meta["whole_model"][size] = {"fwd_s", "bwd_s"}``, which the profiler
records), a span of ``k`` of the ``L`` layers has ``(k - 1) / (L - 1)`` of that excess
removed: exact for a single layer and for the whole model, linear in between.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipesim import span_memory
from pipesim.errors import ProfileError, ProfileRangeError

#: the most a checkpointed pass may save, as a share of the plain forward: a
#: recomputation is a forward, so a saving beyond half of one is noise, not the
#: checkpoint (those measured: 8-15% of the forward, a GPT's whole model on a GPU)
MAX_CHECKPOINT_SAVING = 0.5

#: Column name -> kind ("int", "float", "str"), in file order.
COLUMNS: dict[str, str] = {
    "layer": "int",
    "name": "str",
    "micro_batch": "int",
    "fwd_s": "float",
    "bwd_s": "float",
    "input_bytes": "int",
    "output_bytes": "int",
    "saved_bytes": "int",
    "saved_input_bytes": "int",
    "saved_output_bytes": "int",
    "param_bytes": "int",
}
#: Optional numeric columns, validated when present.
OPTIONAL_COLUMNS: dict[str, str] = {
    "host_fwd_s": "float",
    "host_bwd_s": "float",
    "ckpt_fwd_s": "float",
    "ckpt_bwd_s": "float",
    "fwd_transient_bytes": "float",
    "bwd_transient_bytes": "float",
    "bwd_rise_bytes": "float",
    "bwd_fed_rise_bytes": "float",
    "bwd_input_s": "float",
    "bwd_weight_s": "float",
    "w_pending_bytes": "float",
    "w_received_bytes": "float",
    "autograd_nodes": "int",
}
_TIME_COLUMNS = ("fwd_s", "bwd_s")
_BYTE_COLUMNS = tuple(c for c, k in COLUMNS.items() if c.endswith("_bytes"))


@dataclass(frozen=True)
class LayerCost:
    """Costs of a contiguous run of layers at one micro-batch size (seconds, bytes)."""

    fwd_s: float
    bwd_s: float
    input_bytes: float
    output_bytes: float
    #: bytes kept alive per micro-batch between forward and backward, each tensor
    #: once: the internal saved tensors, the input if saved, and the output.
    stash_bytes: float
    param_bytes: float
    #: the part of the span's output its layers save (the last layer's saved output, or
    #: the one before the Stash layers it ends in): a recomputation makes it anew
    output_saved_bytes: float = 0.0
    #: what ``torch.utils.checkpoint`` adds over ``fwd_s`` to the forward, and over
    #: ``fwd_s + bwd_s`` (recomputation and backward) to the backward, seconds; below 0
    #: where it saves (:meth:`Profile.checkpoint_saving`); 0 when the profile did not
    #: measure it
    ckpt_fwd_extra_s: float = 0.0
    ckpt_bwd_extra_s: float = 0.0
    #: bytes held only while the span's forward runs, above what the forward had kept so
    #: far (peak over its layers); and the same for the backward (see the columns): with
    #: raw backward rises, beside the span's input gradient, which the simulator holds
    #: from the backward's start (the rises place it at the first layer's backward)
    fwd_transient_bytes: float = 0.0
    bwd_transient_bytes: float = 0.0
    #: the largest temporaries of one layer's forward alone (nothing kept before it): what
    #: a checkpointed forward, or a recomputation, holds beside its activations
    fwd_temp_bytes: float = 0.0
    #: the peak of the span's recomputation above its start (a checkpointed backward
    #: re-running the forward: activations so far + one layer's temporaries, as
    #: ``fwd_transient_bytes``), over the layers it re-runs: inside the checkpoint (not a
    #: loss layer, whose loss runs outside it and whose temporaries cannot be told from
    #: the loss's) and up to the last that saves a tensor (the checkpoint stops there).
    #: Beside the span's input gradient, as ``bwd_transient_bytes`` is, where the profile
    #: has raw backward rises: less it (made later, held by the simulator from the start)
    recompute_rise_bytes: float = 0.0
    #: ``bwd_transient_bytes`` without the loss layer's (a span ending in the loss): what
    #: runs after a checkpointed loss stage's recomputation -- the loss is outside the
    #: checkpoint, its backward runs first
    bwd_transient_body_bytes: float = 0.0
    #: a stage's first backward, whose weight gradients stay (``.grad`` was empty): its
    #: peak above the backward's start with the gradients of the layers walked so far,
    #: ``max_j(rise_j + grads of the layers after j)``, plain and after recomputing (as
    #: ``bwd_transient_bytes`` and ``bwd_transient_body_bytes``: a layer's own weight
    #: gradients are in its measured rise, as temporaries, where its peak held them;
    #: :attr:`pipesim.costs.StageCost.bwd_first_transient_bytes`)
    bwd_first_rise_bytes: float = 0.0
    bwd_first_body_bytes: float = 0.0
    #: the backward split in two (seconds): the input gradient ``I`` and the weight
    #: gradients ``W``; scaled like ``bwd_s``, so they add up to it unless the profile
    #: measured a split that costs more than the whole
    bwd_input_s: float = 0.0
    bwd_weight_s: float = 0.0
    #: bytes ``I`` leaves for ``W`` (columns ``w_pending_bytes``, ``w_received_bytes``;
    #: without them, the output gradients of the span's inner layers with parameters)
    w_pending_bytes: float = 0.0
    #: the share of ``fwd_s`` / ``bwd_s`` the host spends issuing the work (columns
    #: ``host_fwd_s``, ``host_bwd_s`` summed over the span against the device seconds,
    #: at most 1): on a GPU, the part of an action a busy host thread delays; 1 where not
    #: profiled (on a CPU the host does the work)
    host_fwd_share: float = 1.0
    host_bwd_share: float = 1.0


@dataclass
class Profile:
    """Measured per-layer costs; see the module docstring for the columns.

    ``table`` holds the rows; ``meta`` the measurement context (device, dtype, torch
    version, threads, repetitions, date, ...).  ``source`` is the file it came from,
    used in error messages.
    """

    table: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        self.table = validate_table(self.table, self.source)
        self.skip_routes()  # validates the skip metadata, if any
        self.stream_speedup(1.0)  # and the measured concurrency law, if any
        self.interpreter_share(1.0)  # and the measured interpreter shares, if any
        self.interpreter_slowdown(1.0)
        self.engine_interpreter_share(1.0)
        self.pair_slowdown(1.0)
        self._validate_whole_model()

    def _validate_whole_model(self) -> None:
        """``meta["whole_model"]``, where present: per micro-batch size, a mapping whose
        ``fwd_s`` and ``bwd_s`` are positive seconds and whose other entries (``ckpt_*``,
        ``split_s``, ...) are seconds too; a ProfileError names the size and entry."""
        whole = self.meta.get("whole_model")
        if not whole:
            return
        where = f"{self.source}: meta['whole_model']"
        if not isinstance(whole, dict):
            raise ProfileError(f"{where} must map a micro-batch size to its seconds, "
                               f"got {type(whole).__name__}")
        for size, times in whole.items():
            if not isinstance(times, dict):
                raise ProfileError(f"{where}[{size!r}] must be a mapping of seconds, "
                                   f"got {times!r}")
            for key in ("fwd_s", "bwd_s"):
                if key not in times:
                    raise ProfileError(f"{where}[{size!r}] has no {key!r}")
            for key, value in times.items():
                plain = key in ("fwd_s", "bwd_s")  # the pass itself: never free
                if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isfinite(value) and (value > 0 if plain else value >= 0)):
                    raise ProfileError(f"{where}[{size!r}][{key!r}] must be "
                                       f"{'positive' if plain else 'non-negative'} seconds, "
                                       f"got {value!r}")

    # ----------------------------------------------------------------- shape
    @cached_property
    def n_layers(self) -> int:
        return int(self.table["layer"].max()) + 1

    @cached_property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(int(v) for v in self.table["micro_batch"].unique()))

    @cached_property
    def layer_names(self) -> list[str]:
        first = self.table.drop_duplicates("layer").sort_values("layer")
        return list(first["name"])

    @cached_property
    def _grid(self) -> dict[str, np.ndarray]:
        """column -> array [n_layers, n_sizes] sorted by layer then size."""
        t = self.table.sort_values(["layer", "micro_batch"])
        n, k = self.n_layers, len(self.micro_batch_sizes)
        return {c: t[c].to_numpy(dtype=float).reshape(n, k)
                for c in _TIME_COLUMNS + _BYTE_COLUMNS + self.optional_columns}

    @cached_property
    def optional_columns(self) -> tuple[str, ...]:
        """The optional columns (see the module docstring) this profile has."""
        return tuple(c for c in OPTIONAL_COLUMNS if c in self.table.columns)

    # ------------------------------------------------------------ interpolate
    def _weights(self, micro_batch: float, extrapolate: bool) -> tuple[int, int, float]:
        """Indices (lo, hi) into the size grid and the weight of hi for linear interpolation."""
        sizes = self.micro_batch_sizes
        lo_size, hi_size = sizes[0], sizes[-1]
        if micro_batch <= 0:
            raise ProfileRangeError(f"micro-batch size must be positive, got {micro_batch}")
        if not lo_size <= micro_batch <= hi_size:
            msg = (
                f"micro-batch size {micro_batch} is outside the profiled range "
                f"[{lo_size}, {hi_size}] of {self.source}"
            )
            if not extrapolate:
                raise ProfileRangeError(msg + "; profile more sizes or pass extrapolate=True")
            warnings.warn(msg + "; extrapolating linearly", stacklevel=3)
        if len(sizes) == 1:
            return 0, 0, 0.0
        hi = int(np.searchsorted(sizes, micro_batch))
        hi = min(max(hi, 1), len(sizes) - 1)
        lo = hi - 1
        w = (micro_batch - sizes[lo]) / (sizes[hi] - sizes[lo])
        return lo, hi, w

    def columns_at(self, micro_batch: float, *, extrapolate: bool = False) -> dict[str, np.ndarray]:
        """Every numeric column for every layer at ``micro_batch`` (cached; see column_at)."""
        key = (float(micro_batch), extrapolate)
        cache = self.__dict__.setdefault("_at_cache", {})
        if key not in cache:
            cache[key] = {c: self._column_at(c, micro_batch, extrapolate)
                          for c in _TIME_COLUMNS + _BYTE_COLUMNS + self.optional_columns}
        return cache[key]

    def column_at(self, column: str, micro_batch: float, *, extrapolate: bool = False) -> np.ndarray:
        """One column for every layer at ``micro_batch`` samples, shape [n_layers].

        Linear in the micro-batch size between the two nearest measured sizes; outside
        the measured range raises :class:`ProfileRangeError` unless ``extrapolate``.
        With one measured size, times and bytes are scaled in proportion.
        """
        return self.columns_at(micro_batch, extrapolate=extrapolate)[column].copy()

    def _column_at(self, column: str, micro_batch: float, extrapolate: bool) -> np.ndarray:
        grid = self._grid[column]
        lo, hi, w = self._weights(micro_batch, extrapolate)
        if lo == hi:
            value = grid[:, 0] * (micro_batch / self.micro_batch_sizes[0])
            if column == "param_bytes":
                value = grid[:, 0]
            return value
        value = grid[:, lo] * (1 - w) + grid[:, hi] * w
        # Extrapolation may cross zero on a falling curve; costs are never negative.
        return np.maximum(value, 0.0)

    def at(self, layer: int, micro_batch: float, *, extrapolate: bool = False) -> dict[str, float]:
        """All columns of one layer at ``micro_batch`` samples (seconds and bytes)."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} not in profile of {self.n_layers} layers")
        cols = self.columns_at(micro_batch, extrapolate=extrapolate)
        return {c: float(cols[c][layer])
                for c in _TIME_COLUMNS + _BYTE_COLUMNS + self.optional_columns}

    def autograd_nodes(self, first: int, stop: int) -> float:
        """Autograd nodes the forward of layers ``first .. stop-1`` creates (per micro-batch,
        whatever its size; the loss's on the last layer); 0 where the profile lacks the
        ``autograd_nodes`` column."""
        if "autograd_nodes" not in self.optional_columns:
            return 0.0
        return float(self._grid["autograd_nodes"][first:stop, 0].sum())

    def span_cost(
        self, first: int, stop: int, micro_batch: float, *, extrapolate: bool = False
    ) -> LayerCost:
        """Cost of layers ``first .. stop-1`` run as one stage on ``micro_batch`` samples:
        its seconds (:meth:`_span_seconds`), the bytes it keeps for its backward
        (:func:`pipesim.span_memory.stash_bytes`) and the bytes it holds while it runs
        (:func:`pipesim.span_memory.pass_rises`).

        ``stash_bytes`` counts each tensor once: a boundary tensor saved by both the
        layer that made it and the layer that reads it is one tensor.
        """
        if not 0 <= first < stop <= self.n_layers:
            raise IndexError(f"layer span [{first}, {stop}) not in 0..{self.n_layers}")
        cols = {c: v[first:stop]
                for c, v in self.columns_at(micro_batch, extrapolate=extrapolate).items()}
        through = span_memory.stash_flags(first, cols, self._pass_through)
        loss_span = self.ends_in_loss(stop)
        stash, output_saved = span_memory.stash_bytes(cols, through, loss_span)
        rises = (span_memory.pass_rises(first, cols, through, loss_span, self._pops)
                 if "fwd_transient_bytes" in cols else {})
        return LayerCost(
            **self._span_seconds(first, stop, micro_batch, cols, extrapolate),
            w_pending_bytes=span_memory.w_pending_bytes(first, cols),
            input_bytes=float(cols["input_bytes"][0]),
            output_bytes=float(cols["output_bytes"][-1]),
            stash_bytes=stash,
            output_saved_bytes=output_saved,
            param_bytes=float(cols["param_bytes"].sum()),
            **rises,
        )

    def _span_seconds(self, first: int, stop: int, micro_batch: float,
                      cols: dict[str, np.ndarray], extrapolate: bool) -> dict[str, float]:
        """A span's seconds, as :class:`LayerCost` fields: its forward and backward (the
        layers' sums less their share of the isolation excess, :meth:`isolation_excess`),
        what the checkpoint adds or saves, the split backward's halves and the host's
        shares of each pass."""
        fwd_layers, bwd_layers = float(cols["fwd_s"].sum()), float(cols["bwd_s"].sum())
        fwd_s, bwd_s = fwd_layers, bwd_layers
        share = (stop - first - 1) / (self.n_layers - 1) if self.n_layers > 1 else 0.0
        excess = self.isolation_excess(micro_batch, extrapolate=extrapolate)
        if excess is not None:
            # never remove more than half of a span's time: a guard against a noisy whole
            fwd_s = max(fwd_s - share * excess[0], fwd_s / 2)
            bwd_s = max(bwd_s - share * excess[1], bwd_s / 2)
        ckpt_fwd = ckpt_bwd = 0.0
        if "ckpt_fwd_s" in cols and "ckpt_bwd_s" in cols:
            # what the checkpoint adds: its entry (random state, hooks set-up) once per
            # call, and a hook per saved tensor.  Per layer, each layer paid an entry; a
            # stage pays one, so the same (k-1)/(L-1) share of the excess over the whole
            # model checkpointed as one call is removed as for the plain times.
            # It may also save: where the device bounds a layer (a GPU at 8-32 samples, a
            # CPU's large GPT), a checkpointed backward measures below the forward and
            # backward it stands for (the H100 and H200 profiles of the GPT, whole model,
            # 8-15% of its forward, and its recorded runs' checkpointed backwards alike).
            # A saving is kept as far as the whole model measured one, in proportion to
            # the span's forward (layers timed one at a time read savings the whole does
            # not: a small layer's noise), never beyond half the span's forward
            # (MAX_CHECKPOINT_SAVING)
            ckpt_fwd = float((cols["ckpt_fwd_s"] - cols["fwd_s"]).sum())
            ckpt_bwd = float((cols["ckpt_bwd_s"] - cols["fwd_s"] - cols["bwd_s"]).sum())
            ck = self.isolation_excess(micro_batch, extrapolate=extrapolate, checkpointed=True)
            if ck is not None:
                ckpt_fwd -= share * ck[0]
                ckpt_bwd -= share * ck[1]
            saving = self.checkpoint_saving(micro_batch, extrapolate=extrapolate)
            ckpt_fwd = max(ckpt_fwd, -min(saving[0], MAX_CHECKPOINT_SAVING) * fwd_s)
            ckpt_bwd = max(ckpt_bwd, -min(saving[1], MAX_CHECKPOINT_SAVING) * fwd_s)
        if "bwd_input_s" in cols and "bwd_weight_s" in cols:
            i_s, w_s = float(cols["bwd_input_s"].sum()), float(cols["bwd_weight_s"].sum())
            split_excess = self.isolation_excess(micro_batch, extrapolate=extrapolate, split=True)
            if split_excess is not None:  # as for fwd_s and bwd_s, at most half removed
                i_s = max(i_s - share * split_excess[0], i_s / 2)
                w_s = max(w_s - share * split_excess[1], w_s / 2)
            scale = 1.0
        else:
            w_s = float(cols["bwd_s"][cols["param_bytes"] > 0].sum()) / 2
            i_s = bwd_layers - w_s
            scale = bwd_s / bwd_layers if bwd_layers > 0 else 1.0  # the isolation correction
        if first == 0:
            # the first stage's input is data: its I computes nothing, its whole backward
            # is W, from the gradient it received
            i_s, w_s = 0.0, i_s + w_s
        host_fwd = host_bwd = 1.0
        if "host_fwd_s" in cols and "host_bwd_s" in cols:
            host_fwd = _share(float(cols["host_fwd_s"].sum()), fwd_layers)
            host_bwd = _share(float(cols["host_bwd_s"].sum()), bwd_layers)
        return {"fwd_s": fwd_s, "bwd_s": bwd_s,
                "host_fwd_share": host_fwd, "host_bwd_share": host_bwd,
                "bwd_input_s": i_s * scale, "bwd_weight_s": w_s * scale,
                "ckpt_fwd_extra_s": ckpt_fwd, "ckpt_bwd_extra_s": ckpt_bwd}

    def ends_in_loss(self, stop: int) -> bool:
        """Whether a span of layers ending before ``stop`` ends in the loss (the profile's
        last layer, when it was measured with the loss)."""
        return stop == self.n_layers and bool(self.meta.get("loss_in_last_layer", False))

    def isolation_excess(self, micro_batch: float, *, extrapolate: bool = False,
                         checkpointed: bool = False, split: bool = False
                         ) -> tuple[float, float] | None:
        """Seconds by which the per-layer sums exceed the whole model (fwd, bwd), or None.

        Interpolated linearly between measured sizes, from ``meta["whole_model"]``.  With
        ``checkpointed``, the same for what the checkpoint adds (the ``ckpt_*`` columns
        less the plain ones, against ``whole_model[size]["ckpt_fwd_s"/"ckpt_bwd_s"]``).
        With ``split``, the excess of the split backward (I, W): the layers' I + W summed
        less the whole model's (``whole_model[size]["split_s"]``), shared between I and W
        as their sums are (each layer's split pays its own graph walk; a stage one).
        """
        whole = self.meta.get("whole_model")
        if not whole:
            return None
        sizes = sorted(int(k) for k in whole)
        if sizes != list(self.micro_batch_sizes):
            return None
        if checkpointed and not (
                "ckpt_fwd_s" in self.optional_columns
                and all("ckpt_fwd_s" in whole[str(b)] for b in sizes)):
            return None
        if split and not ("bwd_input_s" in self.optional_columns
                          and all("split_s" in whole[str(b)] for b in sizes)):
            return None
        key = ("_excess", float(micro_batch), extrapolate, checkpointed, split)
        cache = self.__dict__.setdefault("_at_cache", {})
        if key not in cache:
            lo, hi, w = self._weights(micro_batch, extrapolate)
            g = self._grid
            grid_f, grid_b = g["fwd_s"].sum(axis=0), g["bwd_s"].sum(axis=0)
            ex_f = [grid_f[i] - whole[str(b)]["fwd_s"] for i, b in enumerate(sizes)]
            ex_b = [grid_b[i] - whole[str(b)]["bwd_s"] for i, b in enumerate(sizes)]
            if checkpointed:  # the checkpoint's extra, per layer summed, less the whole's
                ck_f = g["ckpt_fwd_s"].sum(axis=0) - grid_f
                ck_b = g["ckpt_bwd_s"].sum(axis=0) - grid_f - grid_b
                ex_f = [ck_f[i] - (whole[str(b)]["ckpt_fwd_s"] - whole[str(b)]["fwd_s"])
                        for i, b in enumerate(sizes)]
                ex_b = [ck_b[i] - (whole[str(b)]["ckpt_bwd_s"] - whole[str(b)]["fwd_s"]
                                   - whole[str(b)]["bwd_s"]) for i, b in enumerate(sizes)]
            if split:
                gi, gw = g["bwd_input_s"].sum(axis=0), g["bwd_weight_s"].sum(axis=0)
                total = [gi[i] + gw[i] - whole[str(b)]["split_s"] for i, b in enumerate(sizes)]
                ex_f = [t * gi[i] / (gi[i] + gw[i]) if gi[i] + gw[i] > 0 else 0.0
                        for i, t in enumerate(total)]
                ex_b = [t - e for t, e in zip(total, ex_f, strict=True)]
            if lo == hi:
                scale = micro_batch / sizes[0]
                cache[key] = (ex_f[0] * scale, ex_b[0] * scale)
            else:
                cache[key] = (ex_f[lo] * (1 - w) + ex_f[hi] * w, ex_b[lo] * (1 - w) + ex_b[hi] * w)
        return cache[key]

    def checkpoint_saving(self, micro_batch: float, *, extrapolate: bool = False
                          ) -> tuple[float, float]:
        """``(forward, backward)``: what checkpointing the whole model as one call saved
        (``meta["whole_model"]``: the plain forward and backward less the checkpointed
        ones, the recomputation counted as a forward), as shares of the whole model's
        plain forward, linear between measured sizes and the nearest one outside them;
        ``(0, 0)`` where it cost more, or was not measured::

            plain          |== F ==|========= B =========|
            checkpointed   |== F' =|== R ==|===== B' ====|

            forward: (F - F') / F        backward: (F + B - (R + B')) / F

        (a GPT on a GPU at 8-32 samples: backward 0.08-0.15; its recomputed activations
        are read back while fresh)
        """
        shares = self._checkpoint_shares
        if shares is None:
            return 0.0, 0.0
        lo, hi, w = self._weights(micro_batch, extrapolate)
        w = min(max(w, 0.0), 1.0)  # outside the sizes: the nearest one's share
        forward, backward = shares[lo] * (1 - w) + shares[hi] * w
        return max(float(forward), 0.0), max(float(backward), 0.0)

    @cached_property
    def _checkpoint_shares(self) -> np.ndarray | None:
        """:meth:`checkpoint_saving`'s shares at each profiled size, ``[[forward,
        backward], ...]`` (read once); None without a whole-model checkpointed reading at
        every size."""
        whole = self.meta.get("whole_model") or {}
        sizes = sorted(int(k) for k in whole)
        if (not sizes or sizes != list(self.micro_batch_sizes)
                or not all({"ckpt_fwd_s", "ckpt_bwd_s"} <= set(whole[str(b)]) for b in sizes)):
            return None
        return np.array([[(t["fwd_s"] - t["ckpt_fwd_s"]) / t["fwd_s"],
                          (t["fwd_s"] + t["bwd_s"] - t["ckpt_bwd_s"]) / t["fwd_s"]]
                         for t in (whole[str(b)] for b in sizes)])

    def stream_speedup(self, micro_batch: float) -> list[float] | None:
        """The measured concurrency law at ``micro_batch`` (``meta["stream_speedup"]``, see
        the module doc), linear between measured sizes and the nearest one outside them;
        None where it was not measured.  Raises ProfileError on a malformed entry."""
        table = self._measured_by_size("stream_speedup")
        return None if table is None else _at_size(table, micro_batch)

    def _measured_by_size(self, key: str) -> list[tuple[float, list[float]]] | None:
        """``meta[key]`` (``stream_speedup``, ``interpreter_share``,
        ``interpreter_slowdown`` or ``engine_interpreter_share``) parsed, validated and
        sorted by micro-batch size, once; None where it was not measured."""
        cache = self.__dict__.setdefault("_by_size", {})
        if key in cache:
            return cache[key]
        table = self.meta.get(key)
        parsed = None
        if table:
            try:
                if key == "stream_speedup":
                    parsed = sorted((float(size), [float(v) for v in law])
                                    for size, law in table.items())
                elif key == "interpreter_share":  # F, B, and where measured Fc, Bc
                    parsed = sorted((float(size), [float(v[k]) for k in _SHARE_KINDS if
                                                   k in v or k in ("F", "B")])
                                    for size, v in table.items())
                elif key == "pair_slowdown":  # every pair of PAIR_KINDS
                    parsed = sorted((float(size), [float(v[pair]) for pair in PAIRS])
                                    for size, v in table.items())
                elif key == "engine_interpreter_share":  # B and Bc, 0 where not measured
                    parsed = sorted((float(size), [float(v.get(k, 0.0)) for k in ("B", "Bc")])
                                    for size, v in table.items())
                else:  # a slowdown per kind, 1 where not measured
                    parsed = sorted((float(size), [float(v.get(k, 1.0)) for k in _SHARE_KINDS])
                                    for size, v in table.items())
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                shape = ("a list of speedups" if key == "stream_speedup"
                         else "{'B': share, 'Bc': share}" if key == "engine_interpreter_share"
                         else "{'F|F': ratio, 'F|B': ratio, ...} (every pair of F, B, Fc, Bc)"
                         if key == "pair_slowdown"
                         else "{'F': share, 'B': share[, 'Fc': share, 'Bc': share]}")
                raise ProfileError(f"{self.source}: meta['{key}'] must map a micro-batch size "
                                   f"to {shape}, got {table!r}") from exc
            for size, values in parsed:
                if key == "stream_speedup" and (
                        not values or any(not 1.0 <= v <= k + 1 for k, v in enumerate(values))):
                    raise ProfileError(f"{self.source}: meta['{key}'][{size:g}] = {values}: "
                                       "each s_k must lie in [1, k]")
                if (key in ("interpreter_share", "engine_interpreter_share")
                        and not all(0.0 <= v <= 1.0 for v in values)):
                    raise ProfileError(f"{self.source}: meta['{key}'][{size:g}] = "
                                       f"{tuple(values)}: shares lie in [0, 1]")
                if key == "pair_slowdown" and not all(0.0 < v < math.inf for v in values):
                    raise ProfileError(f"{self.source}: meta['{key}'][{size:g}] = "
                                       f"{tuple(values)}: ratios are positive and finite")
                if key == "interpreter_slowdown" and not all(v >= 1.0 for v in values):
                    raise ProfileError(f"{self.source}: meta['{key}'][{size:g}] = "
                                       f"{tuple(values)}: slowdowns are at least 1")
        cache[key] = parsed
        return parsed

    @cached_property
    def _pass_through(self) -> tuple[int, ...]:
        """Layers whose output is their input tensor itself: the skips' Stash layers."""
        return tuple(sorted({src for _, src, _ in self.skip_routes()}))

    @cached_property
    def _pops(self) -> frozenset[int]:
        """The skips' Pop layers: each joins its skip to its input, a new tensor."""
        return frozenset(dst for _, _, dst in self.skip_routes())

    def interpreter_share(self, micro_batch: float) -> tuple[float, float] | None:
        """``(forward, backward)``: the share of an action's seconds its thread holds the
        interpreter (``meta["interpreter_share"]``, see the module doc), linear between
        the measured sizes and the nearest outside them; None where not measured."""
        table = self._measured_by_size("interpreter_share")
        if table is None:
            return None
        forward, backward = _at_size(table, micro_batch)[:2]
        return forward, backward

    def engine_interpreter_share(self, micro_batch: float) -> tuple[float, float]:
        """``(plain, checkpointed)``: the share of a backward's seconds on autograd's
        device thread that also holds the interpreter (``meta["engine_interpreter_share"]``,
        see the module doc), linear between the measured sizes; ``(0, 0)`` where not
        measured: the engine runs a backward in C++, outside the interpreter."""
        table = self._measured_by_size("engine_interpreter_share")
        if table is None:
            return 0.0, 0.0
        plain, checkpointed = _at_size(table, micro_batch)[:2]
        return plain, checkpointed

    def interpreter_slowdown(self, micro_batch: float) -> dict[str, float]:
        """Per pass (``F``, ``B``, ``Fc``, ``Bc``), how much slower than its turn it runs
        while other threads want the interpreter too (``meta["interpreter_slowdown"]``,
        see the module doc); 1 where not measured."""
        table = self._measured_by_size("interpreter_slowdown")
        values = _at_size(table, micro_batch) if table else [1.0] * len(_SHARE_KINDS)
        return dict(zip(_SHARE_KINDS, values, strict=True))

    def repeat_factor(self, micro_batch: float) -> tuple[float, float] | None:
        """``(forward, backward)``: what an action costs, as a share of the profiled one,
        when the action before it on its worker was the same pass of the same stage.

        The profile's seconds are of a forward after a backward and a backward after a
        forward (a 1F1B stage's steady state); a GPipe stage runs its forwards back to
        back, its weights and code still in the caches.  Read off the whole model timed
        both ways (``meta["whole_model"][size]``: ``fwd_repeat_s`` / ``fwd_s``,
        ``bwd_repeat_s`` / ``bwd_s``), linear between sizes and the nearest outside them;
        None for a profile that did not measure it.  Measured, not applied: scaling
        GPipe's repeated forwards by it made the CPU grid worse (MLP 9.3% -> 11.8%
        median, 2026-11-24): in a pipeline they do not run as cheaply as back to back.
        """
        whole = self.meta.get("whole_model") or {}
        table = []
        for size, w in whole.items():
            if not all(k in w for k in ("fwd_s", "bwd_s", "fwd_repeat_s", "bwd_repeat_s")):
                return None
            if w["fwd_s"] <= 0 or w["bwd_s"] <= 0:
                return None
            table.append((float(size), [w["fwd_repeat_s"] / w["fwd_s"],
                                        w["bwd_repeat_s"] / w["bwd_s"]]))
        if not table:
            return None
        forward, backward = _at_size(sorted(table), micro_batch)
        return forward, backward

    def pair_slowdown(self, micro_batch: float) -> dict[str, float] | None:
        """How much longer each pass takes beside another thread running each pass, than
        alone (``meta["pair_slowdown"]``, see the module doc): ``{"X|Y": ratio}`` for X, Y
        in F, B, Fc, Bc, linear between measured sizes and the nearest outside them; None
        where not measured.  Raises ProfileError on a malformed entry."""
        table = self._measured_by_size("pair_slowdown")
        return None if table is None else dict(zip(PAIRS, _at_size(table, micro_batch),
                                                   strict=True))

    def checkpointed_interpreter_share(self, micro_batch: float) -> tuple[float, float] | None:
        """``(forward, backward)`` shares of a checkpointed micro-batch's forward (inside
        ``torch.utils.checkpoint``, whose hooks are Python) and backward (recomputing), as
        :meth:`interpreter_share`; None where only the plain passes were measured."""
        table = self._measured_by_size("interpreter_share")
        if table is None or any(len(values) < 4 for _, values in table):
            return None
        forward, backward = _at_size(table, micro_batch)[2:4]
        return forward, backward

    def skip_routes(self) -> list[tuple[str, int, int]]:
        """Skip connections as ``(name, stashing layer, popping layer)`` (from the metadata)."""
        routes = []
        for i, skip in enumerate(self.meta.get("skips") or []):
            try:
                name, src, dst = skip["name"], int(skip["stash_layer"]), int(skip["pop_layer"])
                sizes = {int(k) for k in skip["bytes"]}
            except (KeyError, TypeError, ValueError) as exc:
                raise ProfileError(f"{self.source}: metadata 'skips' entry {i} is malformed "
                                   f"({exc!r})") from None
            if not 0 <= src < dst < self.n_layers:
                raise ProfileError(f"{self.source}: skip {name!r} goes from layer {src} to {dst}, "
                                   f"not forward inside 0..{self.n_layers - 1}")
            if sizes != set(self.micro_batch_sizes):
                raise ProfileError(f"{self.source}: skip {name!r} has bytes for sizes "
                                   f"{sorted(sizes)}, the table for {list(self.micro_batch_sizes)}")
            routes.append((name, src, dst))
        return routes

    def skip_bytes(self, name: str, micro_batch: float, *, extrapolate: bool = False) -> float:
        """Bytes of skip ``name`` at ``micro_batch`` samples (linear between sizes)."""
        skip = next(k for k in self.meta["skips"] if k["name"] == name)
        lo, hi, w = self._weights(micro_batch, extrapolate)
        sizes = self.micro_batch_sizes
        if lo == hi:
            return skip["bytes"][str(sizes[0])] * micro_batch / sizes[0]
        return skip["bytes"][str(sizes[lo])] * (1 - w) + skip["bytes"][str(sizes[hi])] * w

    def layer_times(self, micro_batch: float, *, extrapolate: bool = False) -> np.ndarray:
        """Forward+backward seconds of every layer at ``micro_batch``, shape [n_layers]."""
        return (self.column_at("fwd_s", micro_batch, extrapolate=extrapolate)
                + self.column_at("bwd_s", micro_batch, extrapolate=extrapolate))

    # ------------------------------------------------------------------- files
    @classmethod
    def mean(cls, profiles: list[Profile], source: str = "<mean>") -> Profile:
        """The mean of several profiles of one model taken at different moments: every
        seconds column (and ``meta["whole_model"]``) averaged, bytes and the rest of the
        metadata the first's; ``meta["averaged_over"]`` says how many.  Taken before and
        after a grid of runs, it times the machine as the runs found it on average.
        Raises ProfileError unless all have the same layers and sizes."""
        return cls._combined(profiles, source, np.mean, "mean")

    @classmethod
    def median(cls, profiles: list[Profile], source: str = "<median>") -> Profile:
        """As :meth:`mean`, each seconds figure the median of the profiles' (``meta
        ["combined_by"]`` ``"median"``): a profile is a few seconds of one moment, and on a
        shared machine one moment of several can read it far slower (one of five taken
        over a 2-core VM's grid, 2026-11-28, +62%) than the minutes the runs take."""
        return cls._combined(profiles, source, np.median, "median")

    @classmethod
    def _combined(cls, profiles: list[Profile], source: str,
                  statistic: Callable[..., Any], name: str) -> Profile:
        """Profiles of one model joined cell by cell: ``statistic`` (over axis 0) of every
        seconds column and of ``meta["whole_model"]``, the rest the first's."""
        if not profiles:
            raise ProfileError(f"Profile.{name} needs at least one profile")
        first = profiles[0]
        key = ["layer", "micro_batch"]
        base = first.table.sort_values(key).reset_index(drop=True)
        seconds = [c for c in base.columns if c.endswith("_s")]
        tables = []
        for p in profiles:
            t = p.table.sort_values(key).reset_index(drop=True)
            if not t[key].equals(base[key]) or not set(seconds) <= set(t.columns):
                raise ProfileError(f"{p.source}: other layers, sizes or columns than "
                                   f"{first.source}: profiles of different models?")
            tables.append(t)
        table = base.copy()
        for c in seconds:
            table[c] = statistic(np.stack([t[c].to_numpy(dtype=float) for t in tables]), axis=0)
        meta = {**first.meta, "averaged_over": len(profiles)}
        if name != "mean":
            meta["combined_by"] = name
        wholes: list[dict] = [p.meta.get("whole_model") or {} for p in profiles]
        if all(wholes):
            meta["whole_model"] = {
                size: {k: float(statistic([float(w[size][k]) for w in wholes])) for k in entry}
                for size, entry in wholes[0].items()}
        return cls(table, meta, source)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (.csv) and its metadata beside it (.json); returns the CSV path."""
        csv_path = Path(path).with_suffix(".csv")
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        self.table[list(COLUMNS) + list(self.optional_columns)].to_csv(csv_path, index=False)
        csv_path.with_suffix(".json").write_text(json.dumps(self.meta, indent=2, default=str))
        return csv_path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and validate a profile written by :meth:`save`.

        Raises :class:`ProfileError` naming the file, column and row of any problem.
        """
        csv_path = Path(path)
        if csv_path.suffix != ".csv":
            csv_path = csv_path.with_suffix(".csv")
        if not csv_path.exists():
            raise ProfileError(f"{csv_path}: no such profile file")
        try:
            # Read as strings so that type problems are reported by us, per cell.
            table = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{csv_path}: not a readable CSV table ({exc})") from exc
        meta_path = csv_path.with_suffix(".json")
        meta: dict[str, Any] = {}
        if meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
            except json.JSONDecodeError as exc:
                raise ProfileError(f"{meta_path}: metadata is not valid JSON ({exc})") from exc
            if not isinstance(meta, dict):
                raise ProfileError(f"{meta_path}: metadata must be a JSON object")
        return cls(table=table, meta=meta, source=str(csv_path))

    def summary(self) -> pd.DataFrame:
        """Per-layer forward/backward ms and MiB at every measured size (for display)."""
        t = self.table.copy()
        t["fwd_ms"] = t["fwd_s"] * 1e3
        t["bwd_ms"] = t["bwd_s"] * 1e3
        t["saved_MiB"] = t["saved_bytes"] / 2**20
        t["output_MiB"] = t["output_bytes"] / 2**20
        return t[["layer", "name", "micro_batch", "fwd_ms", "bwd_ms", "saved_MiB", "output_MiB"]]


def _convert(table: pd.DataFrame, column: str, kind: str, source: str) -> pd.Series:
    """Convert one column to its kind, naming the first bad cell (1-based data row)."""
    values = table[column]
    if kind == "str":
        return values.astype(str)
    numbers = pd.to_numeric(values, errors="coerce")
    bad = numbers.isna() & values.notna()
    if values.dtype == object:
        # Empty strings or words ("fast") come back NaN; the literal "nan" too.
        bad = numbers.isna()
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise ProfileError(
            f"{source}: column '{column}', row {row + 1}: "
            f"{values.iloc[row]!r} is not a number"
        )
    if kind == "int":
        frac = numbers != np.floor(numbers)
        if frac.any():
            row = int(np.flatnonzero(frac.to_numpy())[0])
            raise ProfileError(
                f"{source}: column '{column}', row {row + 1}: "
                f"{values.iloc[row]!r} is not an integer"
            )
        return numbers.astype("int64")
    return numbers.astype(float)


#: the passes whose interpreter share the profiler measures (meta["interpreter_share"])
_SHARE_KINDS = ("F", "B", "Fc", "Bc")
#: the passes of meta["pair_slowdown"]: a forward, a backward, and both for a
#: checkpointed micro-batch (its backward recomputing)
PAIR_KINDS = _SHARE_KINDS
#: its keys, "X|Y": pass X beside a thread running pass Y
PAIRS = tuple(f"{x}|{y}" for x in PAIR_KINDS for y in PAIR_KINDS)


def _at_size(table: list[tuple[float, list[float]]], micro_batch: float) -> list[float]:
    """Values measured per micro-batch size (sorted), linear between the sizes and the
    nearest one outside them (as many values as both neighbours have)."""
    sizes = [size for size, _ in table]
    if micro_batch <= sizes[0]:
        return list(table[0][1])
    if micro_batch >= sizes[-1]:
        return list(table[-1][1])
    hi = next(i for i, size in enumerate(sizes) if size >= micro_batch)
    (a, lo_values), (b, hi_values) = table[hi - 1], table[hi]
    w = (micro_batch - a) / (b - a)
    return [(1 - w) * x + w * y for x, y in zip(lo_values, hi_values, strict=False)]


def _share(host_s: float, device_s: float) -> float:
    """Host seconds over device seconds, in [0, 1] (1 where either is unknown or the
    device did nothing)."""
    share = host_s / device_s if device_s > 0 else math.nan
    return min(max(share, 0.0), 1.0) if math.isfinite(share) else 1.0


def validate_table(table: pd.DataFrame, source: str = "<memory>") -> pd.DataFrame:
    """Check a profile table and return it with proper dtypes; never changes values.

    Rows are numbered from 1 as in a spreadsheet (the header not counted).
    """
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ProfileError(f"{source}: missing column(s) {', '.join(repr(c) for c in missing)}")
    if len(table) == 0:
        raise ProfileError(f"{source}: the profile has no rows")
    table = table.reset_index(drop=True)
    kinds = {**COLUMNS, **{c: k for c, k in OPTIONAL_COLUMNS.items() if c in table.columns}}
    out = pd.DataFrame({c: _convert(table, c, k, source) for c, k in kinds.items()})
    optional = tuple(c for c in OPTIONAL_COLUMNS if c in out.columns)
    for column in _TIME_COLUMNS + optional + _BYTE_COLUMNS + ("layer", "micro_batch"):
        values = out[column].to_numpy(dtype=float)
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ProfileError(f"{source}: column '{column}', row {row + 1}: {values[row]} is not finite")
        low = values < (1 if column == "micro_batch" else 0)
        if low.any():
            row = int(np.flatnonzero(low)[0])
            what = "must be at least 1" if column == "micro_batch" else "is negative"
            raise ProfileError(f"{source}: column '{column}', row {row + 1}: {values[row]:g} {what}")
    dup = out.duplicated(["layer", "micro_batch"], keep="first")
    if dup.any():
        row = int(np.flatnonzero(dup.to_numpy())[0])
        raise ProfileError(
            f"{source}: row {row + 1} duplicates (layer={out['layer'].iloc[row]}, "
            f"micro_batch={out['micro_batch'].iloc[row]})"
        )
    layers = sorted(out["layer"].unique())
    if layers != list(range(len(layers))):
        gap = next(i for i, v in enumerate(layers) if i != v)
        raise ProfileError(f"{source}: column 'layer': layer {gap} is missing (layers must be 0..N-1)")
    sizes = set(out["micro_batch"].unique())
    for layer, group in out.groupby("layer"):
        have = set(group["micro_batch"])
        if have != sizes:
            lacking = sorted(int(v) for v in sizes - have)
            raise ProfileError(
                f"{source}: layer {layer} lacks micro_batch size(s) {lacking} that other layers have"
            )
    for col in ("saved_input_bytes", "saved_output_bytes"):
        over = out[col] > out["saved_bytes"]
        if over.any():
            row = int(np.flatnonzero(over.to_numpy())[0])
            raise ProfileError(
                f"{source}: column '{col}', row {row + 1}: {out[col].iloc[row]} exceeds saved_bytes "
                f"{out['saved_bytes'].iloc[row]}"
            )
    return out


def split_sizes(batch_size: int, chunks: int) -> list[int]:
    """Micro-batch sizes as ``torch.Tensor.chunk`` splits ``batch_size`` rows.

    ``chunk`` uses ceil(batch/chunks) rows per piece, so fewer pieces than ``chunks``
    can come out (10 rows in 4 chunks -> 3, 3, 3, 1; 5 rows in 4 chunks -> 2, 2, 1).
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    step = math.ceil(batch_size / chunks)
    return [min(step, batch_size - start) for start in range(0, batch_size, step)]


def synthetic_profile(n_layers: int, *, fwd_s: float = 1.0, bwd_s: float = 2.0,
                      sizes: tuple[int, ...] = (1, 64), act_bytes: int = 100,
                      saved_bytes: int = 300, param_bytes: int = 1000) -> Profile:
    """A profile of identical layers whose costs are linear in the micro-batch size.

    Each layer costs ``fwd_s``/``bwd_s`` seconds and ``act_bytes`` (input and output),
    ``saved_bytes`` (its input included) *per sample*, and ``param_bytes`` in all, so a
    stage of ``k`` layers on ``b`` samples takes ``k * b * fwd_s`` forward.  For
    what-if studies and for checking the simulator against closed forms.
    """
    rows = [dict(layer=layer, name="Uniform", micro_batch=b, fwd_s=fwd_s * b, bwd_s=bwd_s * b,
                 input_bytes=act_bytes * b, output_bytes=act_bytes * b,
                 saved_bytes=saved_bytes * b, saved_input_bytes=act_bytes * b,
                 saved_output_bytes=0, param_bytes=param_bytes)
            for layer in range(n_layers) for b in sizes]
    return Profile(pd.DataFrame(rows), meta={"device": "synthetic"})
