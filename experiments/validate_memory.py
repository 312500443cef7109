"""Peak memory predicted against every tensor torch allocates, on this machine's CPU.

For each built-in model (profiled once, transients included), a grid of plans -- chunks
1..16, checkpoint never / except_last / always, GPipe, 1F1B and interleaved (2 virtual
stages a device) -- runs with one process per device (gloo); each rank's memory is
measured by :mod:`executor.memtrack` in one tracked iteration (every storage: parameters,
gradients, saved and received tensors, temporaries, recomputation).  The simulator
predicts each device's peak from the profile alone.  Printed: median and max |error| of
the peak per device, per model and checkpoint mode, and an ablation without the profiled
transients; the timeline's shape (where in the step each peak falls, predicted and
measured, and the mean gap between the curves: :func:`pipesim.compare.memory_shape`); a
chart of predicted against measured timelines for a few plans.

    python experiments/validate_memory.py [--models mlp,gpt,unet] [--quick] [--tag T]
Writes experiments/results/validation_memory_cpu.csv/.json and validation_memory_cpu.png.

    python experiments/validate_memory.py --repredict
re-predicts the committed run's peaks (its ``validation_memory_cpu.csv``, every plan and
device) from profiles taken again, without running the plans: memtrack's bytes do not
depend on timing, so a change to the memory model is checked against the same 312 peaks
in seconds.  Prints median and max |error| per model and mode, as run and now; writes
``validation_memory_cpu_repredicted.csv``.

    python experiments/validate_memory.py --lives "unet:gpipe [8,5] m=1 ckpt=always" --stage 0
runs one stage of one grid plan alone (``executor.stage_alone``, its neighbours'
tensors synthesised) under memtrack with every storage labelled by the operator that
made it, and prints the changes of 64 KiB and more in time order with the level after
each, and what is alive at the peak, beside the model's peak for that device: where a
prediction is off, which tensor it is.  Writes ``memory_lives.csv``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch

from executor.distributed import spawn_plans
from executor.models import builtin_job
from executor.profiler import profile
from executor.stage_alone import run_stage_alone
from experiments.common import RESULTS, machine, write_results
from experiments.validate import BATCH, MODELS
from experiments.validation import TRANSIENTS, without_columns
from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.compare import memory_shape
from pipesim.plan import Plan
from pipesim.plot import memory_stack
from pipesim.profile import Profile
from pipesim.schedule import build_schedule
from pipesim.simulator import simulate
from pipesim.trace import COMPUTE_KINDS, Trace, metrics

DEVICES = 2
#: each built-in model's balances, by number of stages: fixed, so that two runs validate
#: the same plans (read off a one-repeat profile, the balance moved from run to run:
#: U-Net [8,5] one day, [6,7] the next).  U-Net [6,7] sends both skips to the second
#: stage, which opens with a Pop; [8,5] only the outer one.  Other models: balanced by
#: their profile's times.
BALANCES = {"mlp": {2: [[4, 4]], 4: [[2, 2, 2, 2]]},
            "gpt": {2: [[3, 3]], 4: [[2, 1, 1, 2]]},
            "unet": {2: [[8, 5], [6, 7]], 4: [[4, 4, 2, 3]]}}


def grid(profile: Profile, quick: bool, name: str = "") -> list[Plan]:
    plans = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        n = DEVICES * v
        if n > profile.n_layers:
            continue
        balances = BALANCES.get(name, {}).get(n) or [
            min_max_partition(profile.layer_times(BATCH // 4), n)]
        for balance in balances:
            for chunks in ((2, 8) if quick else (1, 2, 4, 8, 16)):
                if v > 1 and chunks % DEVICES:
                    continue
                for ckpt in ("never", "except_last", "always"):
                    plans.append(Plan(balance, chunks, BATCH, checkpoint=ckpt,
                                      schedule=schedule, virtual_stages=v))
    return plans


def predicted_peaks(profile: Profile, plan: Plan, cluster: Cluster) -> list[float]:
    trace = simulate(profile, plan, cluster)
    peaks = metrics(trace).peak_memory_bytes
    return [peaks[d.resource] for d in cluster.devices[:plan.n_devices]]


def shapes(predicted: Trace, measured: Trace, cluster: Cluster, n_devices: int) -> list[dict]:
    """Per device, where the peak falls and how alike the two timelines are, along the
    device's actions (:func:`pipesim.compare.memory_shape`; the measured side is the
    tracked step and its actions, ``meta["memory_actions"]``)."""
    out = []
    acts = predicted.actions[predicted.actions.kind.isin(COMPUTE_KINDS)].sort_values("start")
    tracked = measured.meta.get("memory_actions", {})
    for d in range(n_devices):
        pred = predicted.memory[predicted.memory.device == cluster.devices[d].resource]
        meas = measured.memory[measured.memory.device == f"rank{d}"]
        if not (len(pred) and len(meas)):
            out.append({})
            continue
        # along each side's own run of actions on the device (the tracked step runs slower)
        mine = acts[acts.device == d]
        ran = sorted((a[3], a[4]) for a in tracked.get(f"rank{d}", []))
        along = (list(zip(mine.start, mine.end, strict=True)), ran) if ran else (None, None)
        out.append(memory_shape(pred, meas, predicted_actions=along[0],
                                measured_actions=along[1]))
    return out


def model_profile(name: str) -> Profile:
    """The built-in model ``name``'s profile as the grid takes it (its bytes, transients
    included, at every micro-batch size of the grid; one repeat: the peaks do not depend
    on its seconds but through the schedule's overlaps)."""
    job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
    module, loss_fn, x, y = job()
    sizes = sorted({BATCH // c for c in (1, 2, 4, 8, 16)})
    return profile(module, (x, y), sizes, loss_fn=loss_fn, repeats=1, warmup=0,
                   progress=False, checkpointed=False, meta={"model": name})


def repredict(models: list[str], source: Path = RESULTS / "validation_memory_cpu.csv") -> None:
    """Each peak of the committed run ``source`` predicted again from a profile taken now
    (see the module doc): the memory model's check without running a plan."""
    table = pd.read_csv(source)
    table = table[table.model.isin(models)].copy()
    cluster = Cluster.cpu_processes(DEVICES)
    now = []
    for name in models:
        prof = model_profile(name)
        plans = {p.label(): p for p in grid(prof, False, name)}
        peaks: dict[str, list[float]] = {}
        for label in table[table.model == name].plan.unique():
            if label not in plans:
                raise ValueError(f"{source}: plan {label!r} of {name} is not in the grid")
            peaks[label] = predicted_peaks(prof, plans[label], cluster)
        now += [peaks[r.plan][r.device] for r in table[table.model == name].itertuples()]
    table["predicted_now_bytes"] = now
    table["error_now_pct"] = 100 * (table.predicted_now_bytes / table.measured_bytes - 1)
    by = table.groupby(["model", "checkpoint"])
    print(pd.concat({"as run": by.error_pct.agg(lambda e: e.abs().median()),
                     "as run max": by.error_pct.agg(lambda e: e.abs().max()),
                     "now": by.error_now_pct.agg(lambda e: e.abs().median()),
                     "now max": by.error_now_pct.agg(lambda e: e.abs().max())},
                    axis=1).round(2).to_string())
    for col, label in (("error_pct", "as run"), ("error_now_pct", "now")):
        print(f"all {len(table)} peaks, {label}: median |error| "
              f"{table[col].abs().median():.2f}%, max {table[col].abs().max():.1f}%")
    worst = table.reindex(table.error_now_pct.abs().sort_values().index[-8:])
    print(worst[["model", "plan", "device", "measured_bytes", "error_pct",
                 "error_now_pct"]].round(2).to_string(index=False))
    write_results("validation_memory_cpu_repredicted",
                  table[["model", "plan", "device", "checkpoint", "measured_bytes",
                         "predicted_bytes", "predicted_now_bytes", "error_pct",
                         "error_now_pct"]], {**machine(), "source": str(source)})


def lives(spec: str, stage: int, threshold: int = 64 * 1024) -> pd.DataFrame:
    """Every storage of ``stage`` of the plan ``spec`` (``"MODEL:LABEL"``, a plan of the
    grid) run alone, labelled (see the module doc); prints the sequence and the peak."""
    name, label = spec.split(":", 1)
    prof = model_profile(name)
    plans = {p.label(): p for p in grid(prof, False, name)}
    if label not in plans:
        raise ValueError(f"{label!r} is not a plan of {name}'s grid: {sorted(plans)}")
    plan = plans[label]
    module, loss_fn, x, y = builtin_job(name, BATCH, **MODELS[name])
    kept: list = []
    peak = run_stage_alone(module, plan, stage, x, y, loss_fn=loss_fn, iterations=1,
                           keep=kept)["tracked"]
    table = pd.DataFrame(kept[0], columns=["device", "bytes", "born", "freed", "label"])
    origin = table.born.min()
    table["born_ms"] = 1e3 * (table.born - origin)
    table["freed_ms"] = 1e3 * (table.freed - origin)
    events = pd.concat([table.assign(t=table.born_ms, delta=table.bytes),
                        table.dropna(subset=["freed"]).assign(t=lambda d: d.freed_ms,
                                                              delta=lambda d: -d.bytes)])
    events = events.sort_values("t", kind="stable")
    events["level"] = events.delta.cumsum()
    at = float(events.t.iloc[int(events.level.to_numpy().argmax())])
    predicted = predicted_peaks(prof, plan, Cluster.cpu_processes(DEVICES))[
        build_schedule(plan).placement[stage]]
    print(f"{name} {label}, stage {stage} alone: measured peak {peak / 1e6:.3f} MB at "
          f"{at:.2f} ms; the model's for its device {predicted / 1e6:.3f} MB "
          f"(the device's other stages included, where it has any)")
    big = events[events.delta.abs() >= threshold]
    print("changes of 64 KiB and more (ms, MB, level after, what made the storage):")
    for r in big.itertuples():
        print(f"  {r.t:9.2f} {r.delta / 1e6:+8.3f} {r.level / 1e6:8.3f}  {r.label}")
    alive = table[(table.born_ms <= at) & ~(table.freed_ms <= at)]
    print(f"alive at the peak, {len(alive)} storages, {alive.bytes.sum() / 1e6:.3f} MB; the "
          f"largest:")
    for r in alive.sort_values("bytes").tail(20).itertuples():
        print(f"  {r.bytes / 1e6:8.3f} MB since {r.born_ms:9.2f} ms  {r.label or '(before)'}")
    write_results("memory_lives", table.drop(columns=["born", "freed"]),
                  {**machine(), "plan": spec, "stage": stage, "peak_bytes": peak,
                   "predicted_device_peak_bytes": predicted})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    ap.add_argument("--tag", default="", help="suffix of the results' names (a partial grid)")
    ap.add_argument("--repredict", action="store_true",
                    help="re-predict the committed run's peaks, running no plan")
    ap.add_argument("--lives", metavar="MODEL:PLAN",
                    help="one stage of one grid plan alone, every storage labelled")
    ap.add_argument("--stage", type=int, default=0, help="the stage --lives runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.lives:
        lives(args.lives, args.stage)
        return
    if args.repredict:
        repredict(args.models.split(","))
        return
    cluster = Cluster.cpu_processes(DEVICES)
    rows, examples = [], []
    for name in args.models.split(","):
        job = functools.partial(builtin_job, name, BATCH, **MODELS[name])
        prof = model_profile(name)
        bare = without_columns(prof, TRANSIENTS)
        plans = grid(prof, args.quick, name)
        print(f"{name}: {len(plans)} plans", flush=True)
        runs = spawn_plans(job, plans, iterations=1, warmup=1, track_memory=True)
        for plan, (result, _) in zip(plans, runs, strict=True):
            measured = result.trace.meta["peak_memory"]
            pred = predicted_peaks(prof, plan, cluster)
            pred_bare = predicted_peaks(bare, plan, cluster)
            shape = shapes(simulate(prof, plan, cluster), result.trace, cluster, plan.n_devices)
            for d in range(plan.n_devices):
                meas = measured[f"rank{d}"]
                rows.append({"model": name, "plan": plan.label(), "schedule": plan.schedule,
                             "chunks": plan.chunks, "checkpoint": plan.checkpoint, "device": d,
                             "measured_bytes": meas, "predicted_bytes": pred[d],
                             "error_pct": 100 * (pred[d] / meas - 1),
                             "error_no_transients_pct": 100 * (pred_bare[d] / meas - 1),
                             **shape[d]})
            if plan.chunks == 4 and plan.schedule in ("gpipe", "1f1b") and \
                    plan.checkpoint in ("never", "always"):
                examples.append((name, plan, simulate(prof, plan, cluster), result.trace))
        part = pd.DataFrame([r for r in rows if r["model"] == name])
        print(part.groupby("checkpoint")[["error_pct", "error_no_transients_pct"]]
              .agg(lambda e: e.abs().median()).round(2).to_string(), flush=True)
    table = pd.DataFrame(rows)
    summary = {
        "device_peaks": len(table),
        "median_abs_error_pct": float(table.error_pct.abs().median()),
        "max_abs_error_pct": float(table.error_pct.abs().max()),
        "median_signed_error_pct": float(table.error_pct.median()),
        "without_transients": {"median_abs_error_pct": float(table.error_no_transients_pct.abs().median()),
                               "max_abs_error_pct": float(table.error_no_transients_pct.abs().max())},
        # the timeline's shape: where in the step each device's peak falls, and the mean
        # gap between the curves (each on its own step scaled to [0, 1]), of the peak
        "median_abs_peak_shift": float(table.peak_shift.abs().median()),
        "peaks_within_a_tenth_of_the_step": float((table.peak_shift.abs() <= 0.1).mean()),
        "median_shape_error_pct": float(100 * table.shape_error.median()),
        "median_measured_at_predicted_peak": float(table.measured_at_predicted_peak.median()),
        "measured_within_5pct_of_peak_at_predicted_peak": float(
            (table.measured_at_predicted_peak >= 0.95).mean()),
        "per_model_and_mode": {f"{m}/{c}": {"median_abs": float(g.error_pct.abs().median()),
                                            "max_abs": float(g.error_pct.abs().max())}
                               for (m, c), g in table.groupby(["model", "checkpoint"])},
    }
    name = "validation_memory_cpu" + (f"_{args.tag}" if args.tag else "")
    write_results(name, table, {**machine(), "summary": summary,
                                                   "torch": torch.__version__})
    _chart(examples[:6], RESULTS / f"{name}.png")
    print(pd.Series({k: v for k, v in summary.items() if not isinstance(v, dict)}).to_string())
    print("without transients:", summary["without_transients"])


def _chart(examples, path: Path) -> None:
    """Predicted memory stacked by category with the measured total over it (time scaled
    to 0..1: the tracked iteration runs slower than the timed ones), one panel per plan and
    device."""
    if not examples:
        return
    fig, axes = plt.subplots(len(examples), DEVICES, figsize=(13, 2.4 * len(examples)),
                             squeeze=False)
    for row, (name, plan, predicted, measured) in enumerate(examples):
        for d in range(DEVICES):
            ax = axes[row][d]
            memory_stack(predicted, f"cpu{d}", ax, measured=measured, measured_device=f"rank{d}",
                         share_of_iteration=True, title=f"{name} {plan.label()} device {d}")
            ax.title.set_fontsize(8)
            ax.tick_params(labelsize=7)
            if (row, d) != (0, DEVICES - 1):
                ax.get_legend().remove()

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
