"""The Trace: what happened (or is predicted to happen), action by action.

Both the simulator and the executor produce a Trace; one function, :func:`metrics`,
turns either into numbers, so prediction and measurement are compared like for like.

``actions`` columns:

============ ===== ============================================================
iteration    int   0-based training step
device       int   worker index that ran the action (sender for transfers)
stage        int   pipeline stage
microbatch   int   micro-batch index
kind         str   ``F`` forward, ``B`` backward (recomputation included),
                   ``R`` recomputation (a sub-interval of its ``B``),
                   ``SEND_F`` activation transfer, ``SEND_B`` gradient transfer,
                   ``SEND_S``/``SEND_SB`` skip tensor / its gradient
start, end   float seconds from the iteration's origin
nbytes       int   bytes moved (transfers), else 0
resource     str   ``dev0`` for compute, ``dev0->dev1`` for a link
============ ===== ============================================================

Measured traces add ``host_start``, ``host_end`` (float seconds): when the worker's Python
issued the action, beside its device interval ``start``/``end`` (CUDA; empty on CPU,
where they coincide, and for transfers).

``memory`` columns: ``iteration``, ``device`` (physical device name), ``time`` (s),
``bytes`` (allocated after the change at ``time``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipesim.units import format_bytes

ACTION_COLUMNS = ["iteration", "device", "stage", "microbatch", "kind", "start", "end",
                  "nbytes", "resource"]
HOST_COLUMNS = ["host_start", "host_end"]
MEASURED_COLUMNS = ACTION_COLUMNS + HOST_COLUMNS
MEMORY_COLUMNS = ["iteration", "device", "time", "bytes"]
#: the memory timeline split by what it holds (simulated; see pipesim.simulator)
CATEGORY_COLUMNS = ["iteration", "device", "category", "time", "bytes"]
COMPUTE_KINDS = ("F", "B", "I", "W")
TRANSFER_KINDS = ("SEND_F", "SEND_B", "SEND_S", "SEND_SB")


def frame_from_rows(rows: list[tuple], columns: list[str]) -> pd.DataFrame:
    """A DataFrame from row tuples, built column-wise (much faster than row-wise)."""
    if not rows:
        return pd.DataFrame({c: [] for c in columns}, columns=columns)
    data = {}
    for name, values in zip(columns, zip(*rows), strict=True):
        data[name] = np.array(values, dtype=object if isinstance(values[0], str) else None)
    return pd.DataFrame(data, columns=columns)


@dataclass
class Trace:
    """Actions and memory timeline of one or more iterations, plus context in ``meta``.

    ``meta`` holds at least ``batch_size``, ``source`` (``simulated``/``measured``) and
    ``plan`` (a dict); ``peak_memory`` maps device -> peak bytes when the memory timeline
    is coarse (measured runs report allocator peaks rather than full timelines).
    """

    actions: pd.DataFrame
    memory: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MEMORY_COLUMNS))
    meta: dict[str, Any] = field(default_factory=dict)
    #: the memory timeline split by category (:data:`CATEGORY_COLUMNS`; levels per device
    #: and category after each change), where the source knows it; else None
    memory_by_category: pd.DataFrame | None = None

    def save(self, directory: str | Path, prefix: str = "trace") -> Path:
        """Write ``PREFIX_actions.csv``, ``PREFIX_memory.csv`` and ``PREFIX_meta.json`` (and
        ``PREFIX_memory_by_category.csv`` when there is one)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.actions.to_csv(d / f"{prefix}_actions.csv", index=False)
        self.memory.to_csv(d / f"{prefix}_memory.csv", index=False)
        if self.memory_by_category is not None:
            self.memory_by_category.to_csv(d / f"{prefix}_memory_by_category.csv", index=False)
        (d / f"{prefix}_meta.json").write_text(json.dumps(self.meta, indent=2, default=str))
        return d

    @classmethod
    def load(cls, directory: str | Path, prefix: str = "trace") -> Trace:
        d = Path(directory)
        actions = pd.read_csv(d / f"{prefix}_actions.csv")
        missing = [c for c in ACTION_COLUMNS if c not in actions.columns]
        if missing:
            raise ValueError(f"{d / f'{prefix}_actions.csv'}: missing column(s) {missing}")
        memory = pd.read_csv(d / f"{prefix}_memory.csv")
        meta = json.loads((d / f"{prefix}_meta.json").read_text())
        split = d / f"{prefix}_memory_by_category.csv"
        return cls(actions, memory, meta, pd.read_csv(split) if split.exists() else None)

    def iteration(self, i: int) -> Trace:
        """The rows of iteration ``i`` alone."""
        return Trace(self.actions[self.actions["iteration"] == i].reset_index(drop=True),
                     self.memory[self.memory["iteration"] == i].reset_index(drop=True),
                     dict(self.meta))

    @classmethod
    def joined(cls, traces: list[Trace]) -> Trace:
        """One Trace of the iterations of several runs of one plan, laid end to end
        (iterations renumbered, times shifted past the run before); the memory timeline
        and the rest of the metadata are the first run's, ``meta["iterations"]`` the
        total and ``meta["runs"]`` how many were joined."""
        if not traces:
            raise ValueError("joined needs at least one trace")
        parts, iterations, offset = [], 0, 0.0
        time_columns = [c for c in ("start", "end", *HOST_COLUMNS) if c in traces[0].actions]
        for t in traces:
            a = t.actions.copy()
            a["iteration"] = a["iteration"] + iterations
            a[time_columns] = a[time_columns] + offset
            parts.append(a)
            iterations = int(a["iteration"].max()) + 1 if len(a) else iterations
            offset = float(a["end"].max()) if len(a) else offset
        first = traces[0]
        meta = {**first.meta, "iterations": iterations, "runs": len(traces)}
        return cls(pd.concat(parts, ignore_index=True), first.memory, meta,
                   first.memory_by_category)


@dataclass
class Metrics:
    """Numbers of a Trace (seconds, samples/second, bytes)."""

    iteration_time_s: float
    iteration_times_s: list[float]
    throughput: float
    bubble: dict[int, float]
    busy_s: dict[int, float]
    stage_busy_s: dict[int, float]
    peak_memory_bytes: dict[str, float]

    @property
    def mean_bubble(self) -> float:
        return float(np.mean(list(self.bubble.values())))

    def summary(self) -> str:
        peak = max(self.peak_memory_bytes.values(), default=0.0)
        return (f"iteration {self.iteration_time_s * 1e3:.3f} ms, "
                f"throughput {self.throughput:.1f} samples/s, "
                f"bubble {self.mean_bubble:.1%} (mean over devices), "
                f"peak memory {format_bytes(peak)}")

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "throughput": self.throughput,
                "mean_bubble": self.mean_bubble,
                "bubble": {str(k): v for k, v in self.bubble.items()},
                "busy_s": {str(k): v for k, v in self.busy_s.items()},
                "stage_busy_s": {str(k): v for k, v in self.stage_busy_s.items()},
                "peak_memory_bytes": dict(self.peak_memory_bytes),
                "iteration_times_s": list(self.iteration_times_s)}


def metrics(trace: Trace) -> Metrics:
    """Iteration time (median over iterations), throughput, bubble and busy time, peaks.

    * iteration time: first start to last end of an iteration's actions (transfers too);
    * bubble of a device: 1 - (its F and B seconds) / iteration time, median over iterations;
    * busy per stage: F and B seconds of that stage, median over iterations;
    * peak memory: maximum of the memory timeline per device, or ``meta['peak_memory']``.
    """
    a = trace.actions
    if a.empty:
        raise ValueError("the trace has no actions")
    per_iter = a.groupby("iteration").agg(start=("start", "min"), end=("end", "max"))
    times = (per_iter["end"] - per_iter["start"]).to_numpy()
    it_time = float(np.median(times))
    compute = a[a["kind"].isin(COMPUTE_KINDS)]
    dur = compute["end"] - compute["start"]
    busy_iter = dur.groupby([compute["iteration"], compute["device"]]).sum().unstack(fill_value=0.0)
    bubble_iter = 1.0 - busy_iter.div(times[np.searchsorted(per_iter.index, busy_iter.index)], axis=0)
    stage_iter = dur.groupby([compute["iteration"], compute["stage"]]).sum().unstack(fill_value=0.0)
    if trace.meta.get("peak_memory"):
        peaks = {str(k): float(v) for k, v in trace.meta["peak_memory"].items()}
    elif not trace.memory.empty:
        peaks = {str(k): float(v) for k, v in trace.memory.groupby("device")["bytes"].max().items()}
    else:
        peaks = {}
    batch = trace.meta.get("batch_size", 0)
    return Metrics(
        iteration_time_s=it_time,
        iteration_times_s=[float(t) for t in times],
        throughput=batch / it_time if it_time > 0 else float("inf"),
        bubble={int(k): float(v) for k, v in bubble_iter.median().items()},
        busy_s={int(k): float(v) for k, v in busy_iter.median().items()},
        stage_busy_s={int(k): float(v) for k, v in stage_iter.median().items()},
        peak_memory_bytes=peaks,
    )
