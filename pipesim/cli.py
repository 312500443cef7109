"""Console commands that need no torch: ``simulate``, ``tune``, ``compare``.

User mistakes (bad files, impossible plans) print one line ``pipesim: error: ...`` and
exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.errors import PipesimError
from pipesim.plan import CHECKPOINT_MODES, V_SCHEDULES, Plan
from pipesim.profile import Profile
from pipesim.schedule import SCHEDULES
from pipesim.units import format_bytes, parse_bytes

CLUSTER_PRESETS: dict[str, Callable[[int], Cluster]] = {
    "free": Cluster.free,
    "cpu": Cluster.cpu_processes,
    "cpu-threads": Cluster.cpu_threads,
    # (every thread on one core: `run --transport threads --cores 1`, taking turns there)
    "cpu-threads-1core": lambda n: Cluster.cpu_threads(n, cores=1),
    "nvlink": Cluster.nvlink_gpus,
    "pcie": Cluster.pcie_gpus,
    "shared-gpu": Cluster.shared_gpu,
}


_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-[\d.]+\s*[KMGT]?i?B$", re.I)


class UserError(PipesimError):
    """A mistake on the command line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes reach :func:`run` as a UserError: one ``pipesim: error:`` line
    and status 2 for every mistake, whoever finds it."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipesim")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parse_ints(text: str, what: str, *, positive: bool = True) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; refuses an empty list and (by default) values < 1."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise UserError(f"{what} needs at least one integer, got {text!r}")
    if positive and min(values) < 1:
        raise UserError(f"{what} must be positive integers, got {text!r}")
    return values


def at_least(minimum: float, convert: Callable[[str], float] = int) -> Callable[[str], float]:
    """An argparse type: a finite number (``convert``: int or float) of at least ``minimum``."""
    what = "an integer" if convert is int else "a finite number"

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= minimum or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what} of at least {minimum:g}, got {text}")
        return value

    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)
non_negative_float = at_least(0.0, float)


def load_cluster(spec: str, n_devices: int) -> Cluster:
    """A preset name (``free``, ``cpu``, ``cpu-threads``, ``cpu-threads-1core``,
    ``nvlink``, ``pcie``, ``shared-gpu``) or a JSON file."""
    if spec in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[spec](n_devices)
    if Path(spec).suffix == ".json" or Path(spec).exists():
        cluster = Cluster.load(spec)
        if cluster.n_devices < n_devices:
            raise UserError(f"{spec}: the plan needs {n_devices} devices, the cluster has "
                            f"{cluster.n_devices}")
        return cluster
    raise UserError(f"cluster {spec!r} is neither a preset ({', '.join(CLUSTER_PRESETS)}) nor a "
                    "JSON file")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options that make a Plan (shared by simulate and run)."""
    p.add_argument("--balance", help="layers per stage, e.g. 3,3 (default: time-balanced, "
                   "exact min-max partition of the profile)")
    p.add_argument("--stages", type=positive_int, default=2,
                   help="stages when --balance is not given (default 2)")
    p.add_argument("--chunks", type=positive_int, default=4, help="micro-batches (default 4)")
    p.add_argument("--batch-size", type=positive_int, default=32,
                   help="samples per iteration (default 32)")
    p.add_argument("--checkpoint", default="except_last", choices=CHECKPOINT_MODES,
                   help="which micro-batches recompute their forward (default except_last)")
    p.add_argument("--schedule", default="gpipe", choices=sorted(SCHEDULES),
                   help="default gpipe; zb-h1, zb-h2 and zbv split each backward into input "
                   "and weight gradients (zero bubble)")
    p.add_argument("--virtual-stages", type=positive_int, default=None,
                   help="stages per device: for interleaved (default 1); zbv always has 2 "
                   "(--stages counts them all)")
    p.add_argument("--optimizer", default="sgd",
                   help="optimizer state held beside the parameters: sgd (none; what `pipesim run` "
                   "holds, the default), momentum, adam")


def plan_from_args(args: argparse.Namespace, profile: Profile | None) -> Plan:
    if args.balance:
        balance = parse_ints(args.balance, "--balance")
    elif profile is not None:
        # max(1, chunks): a bad chunks count is named by the Plan below, not divided by here
        size = min(max(profile.micro_batch_sizes), max(1, args.batch_size // max(1, args.chunks)))
        size = max(size, min(profile.micro_batch_sizes))
        balance = min_max_partition(profile.layer_times(size), args.stages)
    else:
        raise UserError("--balance is required without a profile")
    plan = Plan(balance=balance, chunks=args.chunks, batch_size=args.batch_size,
                checkpoint=args.checkpoint, schedule=args.schedule,
                virtual_stages=args.virtual_stages or (2 if args.schedule in V_SCHEDULES else 1),
                optimizer=args.optimizer)
    if profile is not None:
        plan.check_layers(profile.n_layers)
    return plan


def write_outputs(trace, out: Path, prefix: str, title: str) -> dict[str, Path]:
    """Trace CSVs, metrics JSON, Gantt and memory PNGs, Chrome trace; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipesim.plot import chrome_trace, gantt, memory_chart
    from pipesim.trace import metrics

    out.mkdir(parents=True, exist_ok=True)
    trace.save(out, prefix)
    m = metrics(trace)
    paths = {"metrics": out / f"{prefix}_metrics.json"}
    paths["metrics"].write_text(json.dumps(m.to_dict(), indent=2))
    # several stages a device (interleaved, V): a row per device shows what it runs
    placement = (trace.meta.get("plan") or {}).get("placement") or []
    by = "device" if len(set(placement)) < len(placement) else "stage"
    if trace.memory.empty:  # no memory panel without a memory timeline
        fig, ax = plt.subplots(1, 1, figsize=(12, 4.5))
        gantt(trace, ax, by=by, title=title)
    else:  # one time axis for both (a measured memory timeline has its own iteration)
        fig, axes = plt.subplots(2, 1, figsize=(12, 7.5), gridspec_kw={"height_ratios": [2, 1]},
                                 sharex=trace.meta.get("source") == "simulated")
        gantt(trace, axes[0], by=by, title=title)
        memory_chart(trace, axes[1], title=None if trace.meta.get("source") == "simulated" else
                     "memory (one extra, tracked iteration: its own time axis)")
    fig.tight_layout()
    paths["png"] = out / f"{prefix}.png"
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    paths["chrome"] = chrome_trace(trace, out / f"{prefix}_chrome.json")
    return paths


def cmd_simulate(args: argparse.Namespace) -> int:
    from pipesim.allocator import allocated_peaks, reserved_peaks
    from pipesim.simulator import Jitter, simulate
    from pipesim.trace import metrics

    profile = Profile.load(args.profile)
    plan = plan_from_args(args, profile)
    cluster = load_cluster(args.cluster, plan.n_devices)
    jitter = Jitter(sigma=args.jitter, seed=args.seed) if args.jitter else None
    trace = simulate(profile, plan, cluster, iterations=args.iterations, jitter=jitter,
                     extrapolate=args.extrapolate)
    m = metrics(trace)
    print(f"plan      {plan.label()}  batch {plan.batch_size}  cluster {cluster.name}  "
          f"optimizer {plan.optimizer} ({plan.optimizer_state_factor:g} bytes of state per "
          "parameter byte)")
    print(f"predicted {m.summary()}")
    # an accelerator's caching allocator reserves more than the tensors hold, and its
    # math libraries' workspaces are allocated too: estimated
    accelerated = any(d.on_accelerator for d in cluster.devices[:plan.n_devices])
    reserved = reserved_peaks(trace) if accelerated else {}
    allocated = allocated_peaks(trace) if accelerated else {}
    for d in sorted(m.bubble):
        device = cluster.devices[d]
        peak = m.peak_memory_bytes.get(device.resource, float("nan"))
        held = reserved.get(device.resource) if device.on_accelerator else None
        need = max(peak, held or 0.0)
        over = (f"  DOES NOT FIT: the device holds {format_bytes(device.memory_bytes)}"
                if need > device.memory_bytes else "")
        estimate = (f"  with workspaces ~{format_bytes(allocated[device.resource])},"
                    f" reserved ~{format_bytes(held)}" if held is not None else "")
        print(f"  device {d}: busy {m.busy_s[d] * 1e3:9.3f} ms  bubble {m.bubble[d]:6.1%}  "
              f"peak {format_bytes(peak):>10}{estimate}{over}")
    paths = write_outputs(trace, Path(args.out), "simulated", f"predicted: {plan.label()}")
    print(f"wrote {paths['png']}, {paths['chrome']} and the trace CSVs in {args.out}")
    return 0


def add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict a plan's timeline, bubble and memory",
                       description="Simulate a plan on a profile with SimPy; print metrics and "
                       "write a Gantt/memory PNG, a Chrome trace (Perfetto) and trace CSVs.")
    p.add_argument("profile", help="profile CSV written by `pipesim profile`")
    add_plan_arguments(p)
    p.add_argument("--cluster", default="free",
                   help=f"preset ({', '.join(CLUSTER_PRESETS)}) or a cluster JSON file")
    p.add_argument("--iterations", type=positive_int, default=1, help="default 1")
    p.add_argument("--jitter", type=non_negative_float, default=0.0,
                   help="log-normal sigma of durations (default 0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (default 0)")
    p.add_argument("--extrapolate", action="store_true",
                   help="allow micro-batch sizes outside the profiled range (warns)")
    p.add_argument("--out", default="out/simulate", help="output folder")
    p.set_defaults(func=cmd_simulate)


def cmd_tune(args: argparse.Namespace) -> int:
    from pipesim.tune import tune

    profile = Profile.load(args.profile)
    cluster = load_cluster(args.cluster, args.devices)
    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    chunks = parse_ints(args.chunks, "--chunks") if args.chunks else None
    result = tune(profile, args.devices, args.batch_size, budget, cluster=cluster, chunks=chunks,
                  schedules=(list(SCHEDULES) if args.schedules == "all"
                             else args.schedules.split(",")), method=args.method,
                  optimizer=args.optimizer, progress=sys.stderr.isatty(),
                  margin=args.memory_margin, tie=args.tie)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = result.table.drop(columns=["plan"])
    table.to_csv(out / "tune.csv", index=False)
    show = table[table.fits].head(args.top).copy()
    show["iteration_ms"] = show.pop("iteration_s") * 1e3
    show["peak_MiB"] = show.pop("peak_bytes") / 2**20
    reserved = show.pop("reserved_bytes") / 2**20
    if reserved.notna().any():  # an accelerator's estimated reserved memory
        show["reserved_MiB"] = reserved
    print(show.round(3).to_string(index=False))
    best = result.best
    (out / "best_plan.json").write_text(json.dumps(best.to_dict(), indent=2))
    print(f"best: {best.label()} ({len(result.table)} plans simulated, "
          f"{int(result.table.fits.sum())} fit {format_bytes(budget)} a device)")
    print(f"wrote {out / 'tune.csv'} and {out / 'best_plan.json'}")
    return 0


def add_tune(sub: argparse._SubParsersAction) -> None:
    from pipesim.tune import TIE

    p = sub.add_parser("tune", help="choose balance, chunks, checkpoint and schedule",
                       description="Rank plans by predicted throughput under a memory budget "
                       "per device (exact min-max balance, refined by simulation).")
    p.add_argument("profile", help="profile CSV written by `pipesim profile`")
    p.add_argument("--devices", type=positive_int, default=2, help="default 2")
    p.add_argument("--batch-size", type=positive_int, default=32, help="default 32")
    p.add_argument("--memory-budget", default="1GiB",
                   help="per device, e.g. 512MiB, 16GiB; a bare number is bytes (default 1GiB)")
    p.add_argument("--memory-margin", type=non_negative_float, default=0.10,
                   help="keep a plan only if its predicted peak plus this share of it fits "
                   "(default 0.10: the prediction's measured under-estimates)")
    p.add_argument("--tie", type=non_negative_float, default=TIE,
                   help=f"plans predicted within this share of the fastest rank by their peak, "
                   f"the smallest first (default {TIE}: closer than the model can tell)")
    p.add_argument("--chunks", help="candidates, e.g. 1,2,4,8 (default: powers of two in range)")
    p.add_argument("--schedules", default="gpipe,1f1b",
                   help=f"comma-separated, of {', '.join(sorted(SCHEDULES))} or all (default "
                   "gpipe,1f1b)")
    p.add_argument("--method", default="minmax", choices=["minmax", "block"],
                   help="balance: exact min-max partition, or torchgpipe-style blocks")
    p.add_argument("--optimizer", default="sgd", help="optimizer state: sgd (default), momentum, adam")
    p.add_argument("--cluster", default="free", help="preset or cluster JSON (default free)")
    p.add_argument("--top", type=positive_int, default=10, help="plans to print (default 10)")
    p.add_argument("--out", default="out/tune", help="output folder (default out/tune)")
    p.set_defaults(func=cmd_tune)


def cmd_compare(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from pipesim.compare import compare
    from pipesim.plot import gantt_pair, memory_pair
    from pipesim.trace import Trace

    try:
        predicted = Trace.load(args.predicted, args.predicted_prefix)
        measured = Trace.load(args.measured, args.measured_prefix)
    except FileNotFoundError as exc:
        raise UserError(f"{exc.filename}: no such trace file") from None
    result = compare(predicted, measured)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.actions.to_csv(out / "compare_actions.csv", index=False)
    result.devices.to_csv(out / "compare_devices.csv", index=False)
    result.iteration.to_csv(out / "compare_iteration.csv", index=False)
    fig = gantt_pair(predicted, measured)
    fig.savefig(out / "compare.png", dpi=110)
    memory_pair(predicted, measured).savefig(out / "compare_memory.png", dpi=110)
    print(result.iteration.round(6).to_string(index=False))
    print(result.summary())
    print(f"wrote compare_*.csv, compare.png and compare_memory.png in {out}")
    return 0


def add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="prediction against measurement",
                       description="Join a predicted and a measured trace action by action; "
                       "print the errors and draw both timelines on one axis.")
    p.add_argument("predicted", help="folder with PREFIX_actions.csv (default prefix simulated)")
    p.add_argument("measured", help="folder with PREFIX_actions.csv (default prefix measured)")
    p.add_argument("--predicted-prefix", default="simulated")
    p.add_argument("--measured-prefix", default="measured")
    p.add_argument("--out", default="out/compare")
    p.set_defaults(func=cmd_compare)


def build_parser(extra: Sequence[Callable[[argparse._SubParsersAction], None]] = ()
                 ) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipesim",
        description="Plan, simulate and validate pipeline-parallel training.")
    parser.add_argument("--version", action="version", version=f"pipesim {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (*extra, add_simulate, add_tune, add_compare):
        add(sub)
    for p in (parser, *sub.choices.values()):
        # "-5MiB" reads as a value (then refused by its parser), not as an unknown option
        p._negative_number_matcher = _NEGATIVE
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except (PipesimError, FileNotFoundError) as exc:
        print(f"pipesim: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader (``| head``) left: stop quietly, and keep Python's exit flush quiet too
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipesim.cli``: the torch-free commands alone."""
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
