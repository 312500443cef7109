"""Two pipeline stages as threads of one process: how much slower is each kind of action
when the other thread works at the same time?

The in-process executor runs each stage in its own thread (on a GPU, each with its own
stream).  A forward is Python issuing operations, under the interpreter's lock; a
backward runs in autograd's engine (on a GPU, its device thread).  This measures, for a
launch-bound model, the median seconds of a forward and of a backward of one half of the
model: alone, and while a second thread runs the other half's forward (or backward) in a
loop.  A ratio near 1 means the two overlap freely; near 2, they take turns.

Seen on this machine's CPU (2 cores, one torch thread each; two runs): a forward beside
another forward 1.8-2.4x alone, a backward beside a backward 1.0-1.1x, a forward beside a
backward 0.9-1.7x (noisy) -- the interpreter, not the cores.  On an H100 (2026-11-23 grid)
forwards of launch-bound stages ran 1.4-2.5x their profile while the other stage's
thread issued.  Modelled since by the interpreter's shares the profiler measures
(``profile(..., interpreter=True)``; ``pipesim/MODEL.md``, "Threads of one process").

    python experiments/thread_interpreter.py [--device cuda:0] [--repeats 30]
Writes experiments/results/[gpu/]thread_interpreter.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import torch
from torch.utils.checkpoint import checkpoint

from executor.models import builtin_job
from executor.partition import split_module
from executor.timing import synchronize
from experiments.common import machine, write_results

SIZES = dict(vocab=256, d_model=32, n_layers=8, n_heads=2, seq_len=8)  # launch-bound
#: forward, backward, and both for a checkpointed micro-batch (torch.utils.checkpoint:
#: Python hooks on every saved tensor; the backward recomputes)
KINDS = ("F", "B", "Fc", "Bc")


def _actions(device: torch.device, batch: int) -> dict[str, list[Callable[[], None]]]:
    """Per kind, one callable per half of the model (F: its forward; B: the backward of
    a graph built once beforehand)."""
    module, loss_fn, x, y = builtin_job("gpt", batch, **SIZES)
    module.to(device)
    halves = split_module(module, [5, 5])
    x, y = x.to(device), y.to(device)
    with torch.no_grad():
        mid = halves[0](x)
    inputs = [x, mid.requires_grad_()]

    def stage(i: int, checkpointed: bool) -> Callable[[], torch.Tensor]:
        if checkpointed:  # as the executor runs a checkpointed micro-batch
            return lambda: checkpoint(halves[i], inputs[i], use_reentrant=False,
                                      preserve_rng_state=True)
        return lambda: halves[i](inputs[i])

    def forward(i: int, checkpointed: bool = False) -> Callable[[], None]:
        run_stage = stage(i, checkpointed)

        def run() -> None:
            out = run_stage()
            del out
        return run

    def backward(i: int, checkpointed: bool = False) -> Callable[[], None]:
        out = stage(i, checkpointed)()
        loss = loss_fn(out, y) if i == 1 else out.float().sum()

        def run() -> None:  # the backward alone (recomputing, when checkpointed): one
            loss.backward(retain_graph=True)  # graph, kept between calls
        return run

    return {"F": [forward(0), forward(1)], "B": [backward(0), backward(1)],
            "Fc": [forward(0, True), forward(1, True)], "Bc": [backward(0, True), backward(1, True)]}


def _on(stream: torch.cuda.Stream | None):
    """The context that issues to ``stream`` (nothing to do on a CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _median_s(fn: Callable[[], None], device: torch.device, repeats: int,
              stream: torch.cuda.Stream | None) -> float:
    """Median seconds of ``fn`` issued to ``stream`` until that stream is done: its own
    stream only, so that the other thread's kernels in flight on its stream are not
    waited for (a device-wide synchronise would time them too)."""
    def done() -> None:
        if stream is not None:
            stream.synchronize()
        else:
            synchronize(device)

    times = []
    with _on(stream):
        fn()
        done()
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            done()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device: torch.device, repeats: int) -> list[dict]:
    actions = _actions(device, 8)
    streams = ([torch.cuda.Stream(device), torch.cuda.Stream(device)]
               if device.type == "cuda" else [None, None])
    rows = []
    for kind in KINDS:
        for other in ("-", *KINDS):
            stop = threading.Event()

            def busy(other: str = other, stop: threading.Event = stop) -> None:
                with _on(streams[1]):
                    while not stop.is_set():
                        actions[other][1]()

            worker = threading.Thread(target=busy, daemon=True) if other != "-" else None
            if worker is not None:
                worker.start()
                time.sleep(0.05)
            seconds = _median_s(actions[kind][0], device, repeats, streams[0])
            stop.set()
            if worker is not None:
                worker.join()
            rows.append({"kind": kind, "beside": other, "median_s": seconds})
    alone = {r["kind"]: r["median_s"] for r in rows if r["beside"] == "-"}
    for r in rows:
        r["ratio_to_alone"] = r["median_s"] / alone[r["kind"]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    table = pd.DataFrame(measure(device, args.repeats))
    print(table.round(4).to_string(index=False))
    subdir = "gpu" if device.type == "cuda" else ""
    write_results("thread_interpreter", table, {**machine(), "device": str(device),
                                                "torch": torch.__version__, "model": SIZES},
                  subdir)


if __name__ == "__main__":
    main()
