"""Pictures of a Trace: Gantt chart, memory over time, Chrome-trace JSON for Perfetto.

matplotlib is imported lazily so ``import pipesim`` stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from pipesim.trace import COMPUTE_KINDS, Trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: colours by action kind (forward, backward, recompute, transfers)
COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#A6D8B2", "R": "#DD8452",
           "SEND_F": "#8C8C8C", "SEND_B": "#B0B0B0", "SEND_S": "#8172B3", "SEND_SB": "#B8A9E0"}
_LABELS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient",
           "R": "recompute", "SEND_F": "send activation",
           "SEND_B": "send gradient", "SEND_S": "send skip", "SEND_SB": "send skip gradient"}


def _rows(actions: pd.DataFrame, by: str) -> list[str]:
    """Row labels of the chart: stages (or devices), then links."""
    compute = actions[actions["kind"].isin([*COMPUTE_KINDS, "R"])]
    keys = sorted(compute[by].unique())
    labels = [f"{by} {k}" for k in keys]
    links = sorted(actions.loc[actions["kind"].str.startswith("SEND"), "resource"].unique())
    return labels + [f"link {r}" for r in links]


def gantt(trace: Trace, ax: Axes | None = None, *, by: str = "stage", title: str | None = None,
          t0: float | None = None, label_microbatches: bool = True) -> Axes:
    """Draw the trace's actions as bars, one row per stage (``by='stage'``) or device.

    Transfers get one row per link.  Recomputation is drawn over the start of its
    backward.  Times are shown in milliseconds from ``t0`` (default: the first start).
    Bars are at least 0.3% of the time span wide, so that short transfers stay visible;
    the legend sits under the axes, off the bars.
    """
    import matplotlib.pyplot as plt

    a = trace.actions
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.45 * max(len(_rows(a, by)), 2) + 1.2))
    rows = _rows(a, by)
    index = {label: i for i, label in enumerate(rows)}
    t0 = float(a["start"].min()) if t0 is None else t0
    min_width = 0.003 * float(a["end"].max() - a["start"].min()) * 1e3
    seen: set[str] = set()
    for kind in ("F", "B", "I", "W", "R", "SEND_F", "SEND_B", "SEND_S", "SEND_SB"):
        part = a[a["kind"] == kind]
        if part.empty:
            continue
        if kind.startswith("SEND"):
            ys = [index[f"link {r}"] for r in part["resource"]]
        else:
            ys = [index[f"{by} {k}"] for k in part[by]]
        starts = (part["start"].to_numpy() - t0) * 1e3
        widths = np.maximum((part["end"] - part["start"]).to_numpy() * 1e3, min_width)
        height = 0.5 if kind == "R" else 0.8
        ax.barh(ys, widths, left=starts, height=height, color=COLOURS[kind], edgecolor="white",
                linewidth=0.5, label=_LABELS[kind] if kind not in seen else None)
        seen.add(kind)
        if label_microbatches and kind in COMPUTE_KINDS and len(part) <= 400:
            for y, x, w, mb in zip(ys, starts, widths, part["microbatch"], strict=True):
                ax.text(x + w / 2, y, str(mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, ncol=len(seen),
              frameon=False)
    if title:
        ax.set_title(title)
    return ax


def memory_chart(trace: Trace, ax: Axes | None = None, *, title: str | None = None) -> Axes:
    """Allocated bytes (MiB) over time per device, as steps."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    mem = trace.memory
    if mem.empty:
        ax.text(0.5, 0.5, "no memory timeline", ha="center", transform=ax.transAxes)
        return ax
    t0 = float(trace.actions["start"].min())
    for device, part in mem.groupby("device", sort=True):
        ax.step((part["time"] - t0) * 1e3, part["bytes"] / 2**20, where="post",
                label=f"device {device}")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax


def chrome_trace(trace: Trace, path: str | Path) -> Path:
    """Write Chrome-trace JSON (opens in Perfetto / chrome://tracing); times in microseconds.

    One process per worker (``pid`` = worker index) with named threads: ``stream``
    (compute: the device interval), ``host`` (when the worker's Python issued each action:
    measured CUDA traces only) and one per outgoing link; memory as counter events of one
    process per physical device.  Ids are integers throughout; names come as metadata.
    Compute events are named as torch.distributed.pipelining names its actions (``1F0``).
    """
    a = trace.actions
    host = "host_start" in a.columns and a["host_start"].notna().any()
    tids: dict[tuple[int, str], int] = {}
    events: list[dict] = []

    def tid(pid: int, name: str) -> int:
        if (pid, name) not in tids:
            tids[(pid, name)] = len([k for k in tids if k[0] == pid])
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tids[(pid, name)],
                           "args": {"name": name}})
        return tids[(pid, name)]

    for w in sorted(int(d) for d in a["device"].unique()):
        events.append({"name": "process_name", "ph": "M", "pid": w, "args": {"name": f"worker {w}"}})
        tid(w, "stream")
        if host:
            tid(w, "host")
    for row in a.itertuples(index=False):
        is_send = str(row.kind).startswith("SEND")
        pid = int(row.device)
        args = {"stage": int(row.stage), "microbatch": int(row.microbatch),
                "iteration": int(row.iteration), "bytes": int(row.nbytes)}
        name = (f"{row.stage}{row.kind}{row.microbatch}" if not is_send
                else f"{row.kind} s{row.stage} mb{row.microbatch}")
        events.append({"name": name, "cat": row.kind, "ph": "X", "ts": float(row.start) * 1e6,
                       "dur": float(row.end - row.start) * 1e6, "pid": pid,
                       "tid": tid(pid, str(row.resource) if is_send else "stream"), "args": args})
        if host and not is_send and row.host_start == row.host_start:  # not NaN
            events.append({"name": name, "cat": "host", "ph": "X",
                           "ts": float(row.host_start) * 1e6,
                           "dur": float(row.host_end - row.host_start) * 1e6, "pid": pid,
                           "tid": tid(pid, "host"), "args": args})
    memory_pid = {d: 1000 + i for i, d in enumerate(sorted(trace.memory["device"].astype(str).unique()))}
    for d, pid in memory_pid.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"memory {d}"}})
    for row in trace.memory.itertuples(index=False):
        events.append({"name": f"memory {row.device}", "ph": "C", "ts": float(row.time) * 1e6,
                       "pid": memory_pid[str(row.device)], "tid": 0,
                       "args": {"MiB": float(row.bytes) / 2**20}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                "metadata": {k: str(v) for k, v in trace.meta.items()}}))
    return path


def gantt_pair(predicted: Trace, measured: Trace, title: str = ""):
    """Predicted above measured on one time axis (measured: its median iteration)."""
    import matplotlib.pyplot as plt

    from pipesim.trace import metrics

    m = metrics(measured)
    times = np.asarray(m.iteration_times_s)
    it = int(np.argsort(times)[len(times) // 2])
    one = measured.iteration(sorted(measured.actions["iteration"].unique())[it])
    fig, axes = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    gantt(predicted.iteration(0), axes[0], title=f"predicted {title}")
    gantt(one, axes[1], title=f"measured {title} (median iteration)")
    fig.tight_layout()
    return fig


def scatter_predicted_measured(table: pd.DataFrame, x: str = "measured_ms",
                               y: str = "predicted_ms", hue: str | None = None,
                               ax: Axes | None = None, title: str = "") -> Axes:
    """Predicted against measured over many plans, with the identity line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5, 5))
    groups = table.groupby(hue) if hue else [("", table)]
    for name, part in groups:
        ax.scatter(part[x], part[y], s=18, alpha=0.8, label=str(name) if hue else None)
    lo = float(min(table[x].min(), table[y].min()))
    hi = float(max(table[x].max(), table[y].max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="identity")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def memory_bars(devices: list[str], predicted: list[float], measured: list[float],
                ax: Axes | None = None, title: str = "") -> Axes:
    """Peak memory per device (MiB), predicted next to measured."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(devices))
    ax.bar(x - 0.2, np.asarray(predicted) / 2**20, 0.4, label="predicted")
    ax.bar(x + 0.2, np.asarray(measured) / 2**20, 0.4, label="measured")
    ax.set_xticks(x, devices)
    ax.set_ylabel("peak (MiB)")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


#: colours of the memory categories (pipesim.steps.MEMORY_CATEGORIES)
CATEGORY_COLOURS = {"parameters": "#8C8C8C", "gradients": "#C44E52", "activations": "#4C72B0",
                    "received": "#8172B3", "temporaries": "#DD8452"}


def _steps(times: np.ndarray, t: np.ndarray, level: np.ndarray) -> np.ndarray:
    """A step function (levels after each change at ``t``) read at ``times``."""
    at = np.searchsorted(t, times, side="right") - 1
    return np.where(at >= 0, level[np.clip(at, 0, None)], 0.0)


def memory_stack(predicted: Trace, device: str, ax: Axes | None = None, *,
                 measured: Trace | None = None, measured_device: str | None = None,
                 share_of_iteration: bool = False, title: str | None = None) -> Axes:
    """One device's predicted memory stacked by category (parameters, gradients,
    activations, received buffers, temporaries), with the measured total over it and,
    where the measured trace has them, the measured categories' boundaries (parameters;
    + gradients; + activations, received buffers included; the rest is temporaries).

    ``share_of_iteration`` puts both on a 0..1 time axis (a tracked measured iteration
    runs slower than the timed ones, so absolute times do not line up).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    split = predicted.memory_by_category
    if split is None or split.empty:
        ax.text(0.5, 0.5, "no memory by category", ha="center", transform=ax.transAxes)
        return ax
    part = split[split.device == device]
    times = np.unique(part.time.to_numpy())
    t0, span = times.min(), max(times.max() - times.min(), 1e-12)
    x = (times - t0) / span if share_of_iteration else (times - t0) * 1e3
    layers, labels, colours = [], [], []
    for category, colour in CATEGORY_COLOURS.items():
        rows = part[part.category == category].sort_values("time", kind="stable")
        if rows.empty:
            continue
        layers.append(_steps(times, rows.time.to_numpy(), rows.bytes.to_numpy()) / 2**20)
        labels.append(category)
        colours.append(colour)
    ax.stackplot(x, layers, labels=labels, colors=colours, step="post", alpha=0.85)
    if measured is not None:
        name = measured_device or device
        mem = measured.memory[measured.memory.device == name].sort_values("time")
        if not mem.empty:
            mt = mem.time.to_numpy()
            m0, mspan = mt.min(), max(mt.max() - mt.min(), 1e-12)

            def scaled(t: np.ndarray) -> np.ndarray:
                return (t - m0) / mspan if share_of_iteration else (t - m0) * 1e3

            ax.step(scaled(mt), mem.bytes / 2**20, where="post", color="black", lw=1.2,
                    label="measured (total)")
            split_m = measured.memory_by_category
            if split_m is not None and not split_m.empty:
                # the measured boundaries between categories, to hold against the stack's
                part_m = split_m[split_m.device == name]
                mtimes = np.unique(part_m.time.to_numpy())
                below = np.zeros(len(mtimes))
                for category, style in (("parameters", ":"), ("gradients", "--"),
                                        ("activations", "-.")):
                    rows = part_m[part_m.category == category].sort_values("time", kind="stable")
                    if rows.empty:
                        continue
                    below = below + _steps(mtimes, rows.time.to_numpy(), rows.bytes.to_numpy())
                    ax.step(scaled(mtimes), below / 2**20, where="post", color="black", lw=0.8,
                            ls=style, label=f"measured up to {category}")
    ax.set_xlabel("time (share of the iteration)" if share_of_iteration else "time (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax


def memory_pair(predicted: Trace, measured: Trace | None = None, title: str | None = None):
    """One chart per device: the predicted memory stacked by category, the measured total
    over it (devices paired in sorted order of their names when both traces have as many;
    time as a share of the iteration, since a tracked measured iteration runs slower).
    Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    devices = sorted(predicted.memory_by_category.device.unique()
                     if predicted.memory_by_category is not None else [])
    others = sorted(measured.memory.device.unique()) if measured is not None else []
    paired = dict(zip(devices, others, strict=True)) if len(others) == len(devices) else {}
    fig, axes = plt.subplots(max(len(devices), 1), 1, figsize=(11, 2.6 * max(len(devices), 1)),
                             squeeze=False)
    for ax, device in zip(axes[:, 0], devices, strict=False):
        memory_stack(predicted, device, ax, measured=measured if device in paired else None,
                     measured_device=paired.get(device), share_of_iteration=True,
                     title=f"device {device}" + (f" (measured: {paired[device]})"
                                                 if device in paired else ""))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
