"""Console commands that need no torch: ``simulate`` (and helpers shared with executor.cli).

User mistakes (bad files, impossible plans) print one line ``pipesim: error: ...`` and
exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipesim.balance import min_max_partition
from pipesim.cluster import Cluster
from pipesim.errors import PipesimError
from pipesim.plan import CHECKPOINT_MODES, Plan
from pipesim.profile import Profile
from pipesim.schedule import SCHEDULES

CLUSTER_PRESETS: dict[str, Callable[[int], Cluster]] = {
    "free": Cluster.free,
    "cpu": Cluster.cpu_processes,
    "nvlink": Cluster.nvlink_gpus,
    "pcie": Cluster.pcie_gpus,
    "shared-gpu": Cluster.shared_gpu,
}


class UserError(PipesimError):
    """A mistake on the command line."""


def parse_ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


def load_cluster(spec: str, n_devices: int) -> Cluster:
    """A preset name (``free``, ``cpu``, ``nvlink``, ``pcie``, ``shared-gpu``) or a JSON file."""
    if spec in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[spec](n_devices)
    if Path(spec).suffix == ".json" or Path(spec).exists():
        return Cluster.load(spec)
    raise UserError(f"cluster {spec!r} is neither a preset ({', '.join(CLUSTER_PRESETS)}) nor a "
                    "JSON file")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options that make a Plan (shared by simulate and run)."""
    p.add_argument("--balance", help="layers per stage, e.g. 3,3 (default: time-balanced, "
                   "exact min-max partition of the profile)")
    p.add_argument("--stages", type=int, default=2, help="stages when --balance is not given")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per iteration (default 32)")
    p.add_argument("--checkpoint", default="except_last", choices=CHECKPOINT_MODES)
    p.add_argument("--schedule", default="gpipe", choices=sorted(SCHEDULES))
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="stages per device for the interleaved schedule")
    p.add_argument("--optimizer", default="adam", help="adam, sgd, momentum (optimizer state)")


def plan_from_args(args: argparse.Namespace, profile: Profile | None) -> Plan:
    if args.balance:
        balance = parse_ints(args.balance, "--balance")
    elif profile is not None:
        size = min(max(profile.micro_batch_sizes), max(1, args.batch_size // args.chunks))
        size = max(size, min(profile.micro_batch_sizes))
        balance = min_max_partition(profile.layer_times(size), args.stages)
    else:
        raise UserError("--balance is required without a profile")
    plan = Plan(balance=balance, chunks=args.chunks, batch_size=args.batch_size,
                checkpoint=args.checkpoint, schedule=args.schedule,
                virtual_stages=args.virtual_stages, optimizer=args.optimizer)
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
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [2, 1]})
    gantt(trace, axes[0], title=title)
    memory_chart(trace, axes[1])
    fig.tight_layout()
    paths["png"] = out / f"{prefix}.png"
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    paths["chrome"] = chrome_trace(trace, out / f"{prefix}_chrome.json")
    return paths


def cmd_simulate(args: argparse.Namespace) -> int:
    from pipesim.simulator import Jitter, simulate
    from pipesim.trace import metrics

    profile = Profile.load(args.profile)
    plan = plan_from_args(args, profile)
    cluster = load_cluster(args.cluster, plan.n_devices)
    jitter = Jitter(sigma=args.jitter, seed=args.seed) if args.jitter else None
    trace = simulate(profile, plan, cluster, iterations=args.iterations, jitter=jitter,
                     extrapolate=args.extrapolate)
    m = metrics(trace)
    print(f"plan      {plan.label()}  batch {plan.batch_size}  cluster {cluster.name}")
    print(f"predicted {m.summary()}")
    for d in sorted(m.bubble):
        peak = m.peak_memory_bytes.get(cluster.devices[d].resource, float("nan"))
        print(f"  device {d}: busy {m.busy_s[d] * 1e3:9.3f} ms  bubble {m.bubble[d]:6.1%}  "
              f"peak {peak / 2**20:9.2f} MiB")
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
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--jitter", type=float, default=0.0, help="log-normal sigma of durations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extrapolate", action="store_true",
                   help="allow micro-batch sizes outside the profiled range (warns)")
    p.add_argument("--out", default="out/simulate", help="output folder")
    p.set_defaults(func=cmd_simulate)


def build_parser(extra: Sequence[Callable[[argparse._SubParsersAction], None]] = ()
                 ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipesim",
        description="Plan, simulate and validate pipeline-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (*extra, add_simulate):
        add(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (PipesimError, FileNotFoundError) as exc:
        print(f"pipesim: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipesim.cli``: the torch-free commands alone."""
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
