"""Is a prediction's error what the actions cost, or how they share the machine?

Every recorded run whose actions were kept is predicted three ways, plan by plan:

* **predicted**: the model as it is, from the run's profile and calibration;
* **alone costs**: the same model, each action at the cost it was measured to have where
  it ran alone, beside no compute of another worker (:func:`pipesim.compare.alone_scale`,
  simulated with :class:`pipesim.simulator.Jitter`'s ``scale``).  Contention, the
  interpreter, autograd's engine, device sharing, gaps and schedule stay the model's;
* **replay**: the run's own durations, contention included
  (:func:`experiments.validation.replay_error`): the schedule and the gaps alone.

So ``predicted - alone costs`` is what the cost of an action alone gets wrong (profile,
isolation correction, checkpoint extras, idle costs), and what stays in ``alone costs``
is the model of actions running together::

    error  |------ predicted ------|
           |-- cost --|- sharing --|       alone costs: the sharing part left
                      |- replay -|         replay: the schedule and gaps left

Not a calibration: the factors come from the very runs compared, to locate an error,
never to predict.  A group of actions that never ran alone (on either side) keeps its
modelled cost; ``scaled_share`` says what share of the measured compute time had a
factor.

Sources: the recorded GPU traces (``../shared/evidence/h100-2026-11-22/traces/``, the
newest GPU variant of :mod:`experiments.repredict_evidence`), the project's GPU grid
(``experiments/results/gpu/``, 2026-11-23) and a CPU grid (``--run``, default the latest
``validate.py`` run in ``experiments/results/``; ``--git N``: the last N committed, each
its own source, ``cpu_COMMIT``).

    python experiments/error_decomposition.py [--sources traces,gpu,cpu] [--run DIR | --git N]
        [--tag cpu] [--name error_decomposition]
e.g. the 16-core grid of the GPU machine's host: ``--sources cpu --run
experiments/results/gpu --tag cpu_4stages --name error_decomposition_cpu16``.
Writes experiments/results/error_decomposition.csv (one row per plan),
error_decomposition_summary.csv (median and max |error| per source, model and dtype) and
error_decomposition_costs.csv (:func:`cost_biases`: what each stage's actions cost alone
against the prediction, over every plan and run).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import pandas as pd

from experiments import repredict_evidence as evidence
from experiments.common import RESULTS, machine, write_results
from experiments.grid_history import committed_runs
from experiments.validation import (
    load_measured_actions,
    measured_trace,
    replay_error,
    saved_grid,
    with_alone_costs,
)
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import Profile
from pipesim.simulator import simulate
from pipesim.trace import COMPUTE_KINDS, Trace, metrics

#: where a validate.py run keeps its measured actions
ACTIONS = "validation_{tag}_actions.csv.gz"

#: the GPU model variant decomposed (repredict_evidence's newest, threads of one process)
GPU_VARIANT = "threads_node_order"

Run = tuple[str, str, str, Profile, Cluster, Plan, Trace]


def decompose(profile: Profile, plan: Plan, cluster: Cluster, measured: Trace,
              costs: list[pd.DataFrame] | None = None) -> dict:
    """Iteration times (ms) of ``plan`` predicted, with alone costs and replayed, beside the
    measured, and the share of the measured compute seconds whose cost was scaled.
    ``costs``, if given, receives the plan's :func:`pipesim.compare.alone_scale` table,
    each stage's layers beside it (``first``, ``stop``)."""
    predicted = simulate(profile, plan, cluster, track_memory=False)
    alone, table = with_alone_costs(profile, plan, cluster, predicted, measured)
    if costs is not None:
        spans = [plan.stage_layers(s) for s in range(plan.n_stages)]
        costs.append(table.assign(first=[spans[s].start for s in table.stage],
                                  stop=[spans[s].stop for s in table.stage]))
    measured_ms = 1e3 * metrics(measured).iteration_time_s
    a = measured.actions[measured.actions["kind"].isin(COMPUTE_KINDS)]
    seconds = (a["end"] - a["start"]).to_numpy()
    # (the groups of actions that had a factor: stage, kind, size, checkpointed)
    scaled = {(int(r.stage), str(r.kind), int(r.micro_batch), bool(r.checkpointed))
              for r in table.itertuples() if np.isfinite(r.scale)}
    sizes = plan.micro_batch_sizes
    has = np.array([(int(s), str(k), sizes[int(m)], plan.checkpointed(int(m))) in scaled
                    for s, k, m in a[["stage", "kind", "microbatch"]].itertuples(index=False)])
    return {"measured_ms": measured_ms,
            "predicted_ms": 1e3 * metrics(predicted).iteration_time_s,
            "alone_costs_ms": 1e3 * alone,
            "replay_ms": measured_ms * (1 + replay_error(profile, plan, measured, cluster)),
            "scaled_share": float(seconds[has].sum() / seconds.sum()) if seconds.sum() else 0.0,
            "alone_scale_median": float(table["scale"].median()) if len(table) else np.nan}


def gpu_traces() -> Iterator[Run]:
    """The recorded GPU traces, each profile and cluster as the newest GPU variant has it."""
    change = evidence.VARIANTS[GPU_VARIANT]
    for model, dtype, profile, cluster, plan, measured in evidence.trace_runs(evidence.EVIDENCE):
        changed = change(profile, cluster)
        if changed is not None:
            yield "gpu_traces", model, dtype, changed[0], changed[1], plan, measured


def gpu_grid() -> Iterator[Run]:
    """The project's GPU grid (two stages as threads on one H100), measured actions kept."""
    runs = load_measured_actions(evidence.LATEST_GPU / "validation_gpu_actions.csv.gz")
    change = evidence.VARIANTS[GPU_VARIANT]
    for model, dtype, profile, cluster, plan, row in evidence._gpu_plans(evidence.LATEST_GPU):
        part = runs.get((row.model, plan.label()))
        changed = change(profile, cluster)
        if part is None or changed is None:
            continue
        yield ("gpu_grid", model, dtype, changed[0], changed[1], plan,
               measured_trace(part, plan))


def cpu_grid(run: Path, tag: str) -> Iterator[Run]:
    """A ``validate.py`` grid, each model as today's model predicts it
    (:func:`experiments.validation.saved_grid`)."""
    grid = saved_grid(run, tag)
    runs = load_measured_actions(run / ACTIONS.format(tag=tag))
    for r in grid.table.itertuples():
        plan = grid.plan(r)
        part = runs.get((r.model, plan.label()))
        if part is None:
            continue
        yield (f"cpu_{run.name}", r.model, "float32", grid.profiles[r.model],
               grid.clusters[r.model], plan, measured_trace(part, plan))


def cost_biases(costs: pd.DataFrame) -> pd.DataFrame:
    """What each stage's actions cost alone against their prediction, over every plan and
    run of a source: per source, model, layers, kind, micro-batch size and checkpointing,
    the median ratio (``bias_pct``: median over actions of measured / predicted - 1, in
    %) and its scatter (``scatter_pct``: standard deviation of the log-ratio, in %).  A
    large bias with little scatter is the cost model's to fix; a large scatter with no
    bias is the machine drifting between the profile and the run."""
    c = costs.dropna(subset=["scale"]).assign(log=lambda t: np.log(t["scale"]))
    out = c.groupby(["source", "model", "first", "stop", "kind", "micro_batch",
                     "checkpointed"]).agg(groups=("log", "size"), log_median=("log", "median"),
                                           log_sd=("log", "std")).reset_index()
    out["bias_pct"] = 100 * (np.exp(out.pop("log_median")) - 1)
    out["scatter_pct"] = 100 * out.pop("log_sd")
    return out


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Median and max |error| (%) of each prediction per source, model and dtype."""
    t = table.copy()
    columns = []
    for name in ("predicted", "alone_costs", "replay"):
        t[name] = 100 * (t[f"{name}_ms"] / t["measured_ms"] - 1)
        columns.append(name)
    out = t.groupby(["source", "model", "dtype"], sort=False).agg(
        plans=("plan", "size"), scaled_share=("scaled_share", "median"),
        **{f"{c}_median": (c, lambda e: e.abs().median()) for c in columns},
        **{f"{c}_max": (c, lambda e: e.abs().max()) for c in columns},
        **{f"{c}_signed": (c, "median") for c in columns})
    return out.reset_index()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="traces,gpu,cpu")
    ap.add_argument("--run", type=Path, default=RESULTS, help="a validate.py results folder")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--name", default="error_decomposition",
                    help="what the result files are called (NAME.csv, NAME_summary.csv, "
                         "NAME_costs.csv)")
    ap.add_argument("--git", type=int, default=0, metavar="N",
                    help="the CPU source: the last N grids committed (those that kept their "
                         "actions), in place of --run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [args.run]
        if args.git:
            runs = [f for f in committed_runs(args.git, Path(tmp), args.tag, also=(ACTIONS,))
                    if (f / ACTIONS.format(tag=args.tag)).exists()]
        sources = {"traces": gpu_traces, "gpu": gpu_grid,
                   "cpu": lambda: (r for run in runs for r in cpu_grid(run, args.tag))}
        rows, costs = [], []
        for name in args.sources.split(","):
            if name not in sources:
                raise SystemExit(f"--sources: unknown source {name!r} "
                                 f"(known: {', '.join(sources)})")
            for source, model, dtype, profile, cluster, plan, measured in sources[name]():
                parts: list[pd.DataFrame] = []
                rows.append({"source": source, "model": model, "dtype": dtype,
                             "plan": plan.label(),
                             **decompose(profile, plan, cluster, measured, parts)})
                # (the CPU runs' costs pooled over runs: a bias shows through their drift)
                pooled = "cpu" if source.startswith("cpu_") else source
                costs += [p.assign(source=pooled, model=f"{model}/{dtype}") for p in parts]
    table = pd.DataFrame(rows)
    summary = summarise(table)
    cpu = table[table.source.str.startswith("cpu_")]
    if cpu.source.nunique() > 1:  # and the CPU runs together
        summary = pd.concat([summary, summarise(cpu.assign(
            source=f"cpu_{cpu.source.nunique()}_runs"))], ignore_index=True)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    meta = {**machine(), "sources": args.sources, "run": str(args.run), "gpu_variant": GPU_VARIANT}
    write_results(args.name, table, meta)
    biases = cost_biases(pd.concat(costs, ignore_index=True))
    write_results(f"{args.name}_costs", biases, meta)
    with pd.option_context("display.width", 200, "display.max_rows", 60):
        for source, part in biases[biases.groups >= 3].groupby("source"):
            print(f"{source}: the alone costs furthest from the prediction (median over "
                  "plans and runs, >= 3 of them)")
            print(part.sort_values("bias_pct", key=abs, ascending=False).head(8)
                  .to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    path = write_results(f"{args.name}_summary", summary, meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
