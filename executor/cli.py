"""The ``pipesim`` console command: torch-side commands added to pipesim's own.

``profile`` and ``demo`` need torch; ``simulate`` comes from :mod:`pipesim.cli` unchanged.
torch is imported only when a torch-side command runs, so ``pipesim simulate`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from executor.cores import first_cores, threads_on
from pipesim.balance import stage_firsts
from pipesim.cli import (
    CLUSTER_PRESETS,
    UserError,
    build_parser,
    non_negative_int,
    parse_ints,
    positive_int,
    run,
)

if TYPE_CHECKING:
    from typing import TypeVar

    from pipesim.cluster import Cluster
    from pipesim.plan import Plan
    from pipesim.profile import Profile
    from pipesim.readings import CheckpointExtra, ExecutorGap, IdleCost, SpanSlowdown

    #: rows measured in place for a span of layers
    Spanned = TypeVar("Spanned", IdleCost, CheckpointExtra, ExecutorGap, SpanSlowdown)


def torch_dtype(name: str):
    """The floating torch dtype called ``name``; a UserError for anything else."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UserError(f"--dtype {name!r} is not a floating-point torch dtype (try float32, "
                        "bfloat16, float16, float64)")
    return dtype


def check_device(name: str) -> None:
    """Refuse a device this torch cannot use, before any work starts."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UserError(f"--device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name!r}: this torch ({torch.__version__}) sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")


def parse_sizes(pairs: Sequence[str]) -> dict:
    """``["width=256", "depth=4"]`` -> ``{"width": 256, "depth": 4}`` (ints where possible)."""
    sizes: dict[str, int | float | str] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            sizes[key] = int(value)
        except ValueError:
            try:
                sizes[key] = float(value)
            except ValueError:
                sizes[key] = value
    return sizes


def profile_model(model_name: str, sizes: dict, micro_batches: list[int], device: str,
                  dtype: str, repeats: int, warmup: int, progress: bool = True,
                  **measure):
    """Build a built-in model and profile it; returns ``(BuiltinModel, Profile)``.
    ``measure`` adds the profiler's optional measurements (``streams``, ``interpreter``,
    ``pairs``: :func:`executor.profiler.profile`)."""

    from executor.models import build_model
    from executor.profiler import profile

    check_device(device)
    dt = torch_dtype(dtype)
    try:
        built = build_model(model_name, **sizes)
    except (TypeError, ValueError) as exc:
        raise UserError(f"model {model_name!r}: {exc}") from None
    batch = built.make_batch(max(micro_batches))
    prof = profile(built.module, batch, micro_batches, device, loss_fn=built.loss_fn,
                   repeats=repeats, warmup=warmup, dtype=dt, progress=progress, **measure,
                   meta={"model": model_name, "model_sizes": built.sizes})
    return built, prof


#: the built-in models' names, here so that help text needs no torch (a test checks them
#: against executor.models.BUILTIN_MODELS)
MODEL_NAMES = ("gpt", "mlp", "resnet", "resnet_skip", "unet")


def _models() -> str:
    return ", ".join(MODEL_NAMES)


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt", help=f"built-in model: {_models()} (default gpt)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model size, e.g. --set n_layers=6 (repeatable)")
    p.add_argument("--dtype", default="float32", help="floating dtype (default float32)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (default 1: what each rank of `run --transport processes` "
                   "uses; profile with the threads the run will have)")


def add_profile_options(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--sizes", default="1,2,4,8", help="micro-batch sizes to measure (default 1,2,4,8)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed passes over all layers per size (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="untimed passes first (default 2)")


def add_sharing_options(p: argparse.ArgumentParser) -> None:
    """How stage threads share a device and the interpreter, measured by the profiler."""
    p.add_argument("--streams", type=non_negative_int, default=0, metavar="K",
                   help="also measure how 1..K threads, each with its own stream, share the "
                   "device at each size (stages as threads on one GPU: K = the stages; "
                   "meta['stream_speedup'])")
    p.add_argument("--interpreter", action="store_true",
                   help="also measure the share of each pass that holds the interpreter, and "
                   "its slowdown while contended (stages as threads of one process)")
    p.add_argument("--pairs", action="store_true",
                   help="also time each pass beside each other pass (16 pairs a size; for "
                   "a cluster with thread_pairs)")


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    sizes = parse_ints(args.sizes, "--sizes")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.streams == 1:
        raise UserError("--streams 1: the device's sharing needs 2 or more threads")
    _, prof = profile_model(args.model, parse_sizes(args.set), sizes, args.device, args.dtype,
                            args.repeats, args.warmup, streams=args.streams,
                            interpreter=args.interpreter, pairs=args.pairs)
    path = prof.save(args.out)
    print(prof.summary().round(4).to_string(index=False))
    print(f"profiled {prof.n_layers} layers x {len(sizes)} sizes in "
          f"{time.perf_counter() - t0:.1f} s; wrote {path} and {path.with_suffix('.json')}")
    return 0


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure a built-in model's layers",
                       description="Profile every layer of a built-in model at several "
                       "micro-batch sizes; write PROFILE.csv and PROFILE.json.")
    add_profile_options(p)
    add_sharing_options(p)
    p.add_argument("--out", default="out/profile.csv", help="profile CSV path")
    p.set_defaults(func=cmd_profile)


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end to end on the default model (CPU)",
                       description="Profile the default model, balance it, simulate GPipe and "
                       "1F1B, and write every output under --out.")
    p.add_argument("--out", default="out/demo")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    p.set_defaults(func=lambda a: __import__("executor.demo", fromlist=["main"]).main(a))


def default_cluster(transport: str, device: str, cores: int | None = None) -> str:
    """The cluster preset that predicts a run of ``transport`` on ``device`` where the user
    names none: CPU processes, or the threads of one process on the CPU (all on one core
    with ``cores`` 1) or on one GPU."""
    if transport == "processes":
        return "cpu"
    if device.split(":")[0] != "cpu":
        return "shared-gpu"
    return "cpu-threads-1core" if cores == 1 else "cpu-threads"


def _calibrate_hint(args: argparse.Namespace, plan: Plan) -> str:
    """Where ``run`` predicted with a preset (rough overheads, nothing of this machine's
    pace): the ``calibrate`` command that measures this machine's cluster for the plan's
    balance, its stages in place (idle costs on the CPU, stage costs on a GPU)."""
    on_gpu = args.transport == "threads" and args.device.split(":")[0] != "cpu"
    how = (f" --transport threads --device {args.device} --stage-costs" if on_gpu else
           (" --transport threads" if args.transport == "threads" else "") + " --idle-costs")
    model = f" --model {args.model}" + "".join(f" --set {kv}" for kv in args.set or ())
    model += f" --dtype {args.dtype}" if args.dtype != "float32" else ""
    # (an interleaved plan's balance is of its virtual stages: calibrate measures one
    # stage a worker, the profile's time-balanced split by default)
    layout = f" --stages {plan.n_devices}" if plan.n_devices != 2 else ""
    layout += f" --cores {args.cores}" if args.cores else ""
    if len(plan.balance) == plan.n_devices:
        layout += f" --balance {','.join(map(str, plan.balance))}"
    return (f"(predicted with the {default_cluster(args.transport, args.device, args.cores)} "
            "preset; "
            f"this machine's: `pipesim calibrate{how} {args.profile}{model}{layout} "
            f"--batch-size {plan.batch_size}`, then --cluster)")


def placement_warning(cluster: Cluster, path: str, cores: set[int] | None,
                      workers: int) -> str | None:
    """Where ``workers`` stage threads on the CPU run on other cores than ``cluster`` (from
    ``path``) has them (:func:`executor.cores.threads_on`: ``--cores``), what to do; None
    where they agree.  A one-core run takes turns where threads placed freely overlap, and the other
    way round: the small models of the threads grid ran 0.49-0.87x as long on one core."""
    import os

    used = cluster.devices[:workers]
    if not all(d.process for d in used):
        return None  # not stage threads of one process: another mismatch, not placement
    shared = len({d.resource for d in used})
    have = len(cores) if cores else len(os.sched_getaffinity(0))
    want = min(have, workers)
    if shared == want:
        return None
    return (f"{path} has the threads on {shared} core(s), this run on {want}: calibrate "
            f"again with{f' --cores {len(cores)}' if cores else 'out --cores'} for its "
            "placement")


def threads_profile_warning(profile: Profile, path: str, device: str, stages: int
                            ) -> str | None:
    """What a profile at ``path`` lacks for predicting ``stages`` stage threads on
    ``device`` (None: nothing): on the CPU the interpreter's shares (``--interpreter``),
    on a GPU the device's measured concurrency law (``--streams``)."""
    if device.split(":")[0] == "cpu":
        if profile.interpreter_share(profile.micro_batch_sizes[0]) is None:
            return (f"{path} has no interpreter shares: stage threads on the CPU are predicted "
                    "as if they did not share the interpreter (profile with --interpreter)")
    elif len(profile.stream_speedup(profile.micro_batch_sizes[0]) or ()) < stages:
        return (f"{path} has no measured concurrency law for {stages} streams: stages sharing "
                "the GPU are predicted by the law its size scaling implies (profile with "
                f"--streams {stages})")
    return None


def add_cores_option(p: argparse.ArgumentParser) -> None:
    """``--cores N``: the threads transport's threads on this process's first N cores."""
    p.add_argument("--cores", type=positive_int, default=None,
                   help="threads transport: every thread of this process on its first N cores "
                   "(default: where the operating system puts them). On one core stage threads "
                   "take turns without handing the interpreter across cores: the small models "
                   "of experiments/validate_threads.py ran 0.49-0.87x as long there on a "
                   "2-core VM; a model whose operations overlap on two cores runs longer")


def thread_cores(args: argparse.Namespace) -> set[int] | None:
    """The cores ``--cores`` asks for (None: not given); a user error for the processes
    transport (``--pin`` places those) or more cores than this process has."""
    if args.cores is None:
        return None
    if args.transport != "threads":
        raise UserError(f"--cores {args.cores} is for --transport threads (processes: --pin)")
    if args.device != "cpu":
        raise UserError(f"--cores {args.cores} with --device {args.device}: for stage threads "
                        "on the CPU (a GPU's host threads: experiments/switch_interval.py)")
    try:
        return first_cores(args.cores)
    except ValueError as exc:
        raise UserError(f"--cores {args.cores}: {exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    import functools

    import matplotlib

    matplotlib.use("Agg")
    import torch

    from executor.models import builtin_job
    from pipesim.cli import load_cluster, plan_from_args, write_outputs
    from pipesim.costs import PlanCosts
    from pipesim.plan import Plan
    from pipesim.profile import Profile
    from pipesim.trace import metrics

    sizes = parse_sizes(args.set)
    torch_dtype(args.dtype)
    if args.transport == "threads":
        check_device(args.device)
    cores = thread_cores(args)
    torch.set_num_threads(args.threads)
    profile = Profile.load(args.profile) if args.profile else None
    job = functools.partial(builtin_job, args.model, args.batch_size, dtype=args.dtype, **sizes)
    try:
        module, loss_fn, x, y = job()
    except (TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"model {args.model!r}: {exc}") from None
    if args.plan:
        try:
            plan = Plan.from_dict(json.loads(Path(args.plan).read_text()), source=args.plan)
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{args.plan}: cannot read a plan ({exc})") from None
        if plan.batch_size != args.batch_size:  # the model's batch follows the plan
            job = functools.partial(builtin_job, args.model, plan.batch_size, dtype=args.dtype,
                                    **sizes)
            module, loss_fn, x, y = job()
    else:
        if profile is None and not args.balance:
            from pipesim.balance import even_balance

            args.balance = ",".join(map(str, even_balance(len(module), args.stages)))
        plan = plan_from_args(args, profile)
    plan.check_layers(len(module))
    if profile is not None:
        # before running: a plan outside the profile's sizes is refused now, not after the run
        PlanCosts(profile, plan)
        lacking = (threads_profile_warning(profile, args.profile, args.device, plan.n_devices)
                   if args.transport == "threads" else None)
        if lacking:
            print(f"pipesim: warning: {lacking}", file=sys.stderr)
        threads = profile.meta.get("threads")
        if threads is not None and int(threads) != args.threads:
            print(f"pipesim: warning: {args.profile} was measured with {threads} torch threads, "
                  f"this run uses {args.threads}: the prediction will be off by the difference "
                  "(profile again with --threads)", file=sys.stderr)
    if args.transport == "processes":
        from executor.distributed import spawn

        print(f"running {plan.label()} with {plan.n_devices} processes ...", flush=True)
        result, _ = spawn(job, plan, iterations=args.iterations, warmup=args.warmup,
                          pin_cores=args.pin, threads_per_rank=args.threads)
    else:
        from executor.pipeline import Pipeline

        devices = [args.device] * plan.n_devices
        print(f"running {plan.label()} with {plan.n_devices} threads"
              f"{f' on {len(cores)} core(s)' if cores else ''} ...", flush=True)
        with threads_on(cores), Pipeline(module, plan, devices, loss_fn) as pipe:
            result = pipe.run(x, y, iterations=args.iterations, warmup=args.warmup)
    m = metrics(result.trace)
    times = sorted(m.iteration_times_s)
    print(f"plan      {plan.label()}  batch {plan.batch_size}  transport {args.transport}")
    print(f"measured  {m.summary()}  (median of {args.iterations}; iterations "
          f"{times[0] * 1e3:.2f}-{times[-1] * 1e3:.2f} ms; loss {result.loss:.4f})")
    out = Path(args.out)
    paths = write_outputs(result.trace, out, "measured", f"measured: {plan.label()}")
    if profile is not None:
        from pipesim.compare import compare
        from pipesim.plot import gantt_pair, memory_pair
        from pipesim.simulator import simulate

        if cores and not args.cluster:  # the preset's threads, taking turns on those cores
            from pipesim.cluster import Cluster

            cluster = Cluster.cpu_threads(plan.n_devices, cores=len(cores))
        else:
            cluster = load_cluster(args.cluster or default_cluster(args.transport, args.device),
                                   plan.n_devices)
        if (args.transport == "threads" and args.device == "cpu" and args.cluster
                and args.cluster not in CLUSTER_PRESETS):  # a calibrated cluster's placement
            placed = placement_warning(cluster, args.cluster, cores, plan.n_devices)
            if placed:
                print(f"pipesim: warning: {placed}", file=sys.stderr)
        predicted = simulate(profile, plan, cluster)
        write_outputs(predicted, out, "simulated", f"predicted: {plan.label()}")
        cmp = compare(predicted, result.trace)
        print(f"compare   {cmp.summary()}")
        if not args.cluster:
            print(f"          {_calibrate_hint(args, plan)}")
        gantt_pair(predicted, result.trace, plan.label()).savefig(out / "compare.png", dpi=110)
        memory_pair(predicted, result.trace, plan.label()).savefig(out / "compare_memory.png",
                                                                   dpi=110)
    print(f"wrote {paths['png']}, {paths['chrome']} and the trace CSVs in {out}")
    return 0


def add_run(sub: argparse._SubParsersAction) -> None:
    from pipesim.cli import add_plan_arguments

    p = sub.add_parser("run", help="execute a plan for real and record its trace",
                       description="Run a plan on a built-in model with the executor (threads "
                       "in one process, or one process per stage) and record a measured trace; "
                       "with --profile, also predict it and compare.")
    add_model_options(p)
    add_plan_arguments(p)
    p.add_argument("--plan", help="a plan JSON (the best_plan.json `pipesim tune` writes); "
                   "replaces the plan options")
    p.add_argument("--transport", default="threads", choices=["threads", "processes"],
                   help="threads in one process, or one process per stage (gloo); default threads")
    p.add_argument("--device", default="cpu", help="device of every stage (threads transport)")
    p.add_argument("--pin", action="store_true",
                   help="each process on its own cores (steadier timings on a small host: "
                   "executor.distributed.rank_cores)")
    add_cores_option(p)
    p.add_argument("--iterations", type=positive_int, default=5, help="measured (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="unmeasured first (default 2)")
    p.add_argument("--profile", help="profile CSV: also simulate the plan and compare")
    p.add_argument("--cluster", default=None,
                   help="cluster preset or JSON for the prediction (`pipesim calibrate` "
                   "writes one for this machine; default the transport's preset: cpu for "
                   "processes, cpu-threads or shared-gpu for threads on --device)")
    p.add_argument("--out", default="out/run", help="output folder (default out/run)")
    p.set_defaults(func=cmd_run)


def _in_place_inputs(args: argparse.Namespace, path: str, flag: str
                     ) -> tuple[Profile, list[list[int]], Callable, list[int]]:
    """What a measurement in place reads, checked before its minutes start: the profile at
    ``path`` (given as ``flag``), the balances (``--balance``, repeatable; default the
    profile's time-balanced one), the built-in job and the profile's micro-batch sizes
    that fit ``--batch-size``."""
    import functools

    from executor.models import builtin_job
    from pipesim.balance import min_max_partition
    from pipesim.errors import PipesimError
    from pipesim.profile import Profile
    from pipesim.tune import tuned_balances

    try:
        profile = Profile.load(path)
    except (OSError, PipesimError, ValueError) as exc:
        raise UserError(f"{flag} {path}: {exc}") from None
    sizes = [b for b in profile.micro_batch_sizes if b <= args.batch_size]
    if not sizes:
        raise UserError(f"{flag} {path}: no micro-batch size of the profile "
                        f"({profile.micro_batch_sizes}) fits --batch-size {args.batch_size}")
    if args.balance and "tuned" in args.balance:
        # every balance the tuner tries for this batch: its candidates then all cost what
        # was measured, one ruler
        try:
            balances = tuned_balances(profile, args.stages, args.batch_size)
        except PipesimError as exc:
            raise UserError(f"--balance tuned: {exc}") from None
        for given in (parse_ints(b, "--balance") for b in args.balance if b != "tuned"):
            balances += [given] if given not in balances else []
    else:
        balances = ([parse_ints(b, "--balance") for b in args.balance] if args.balance else
                    [min_max_partition(profile.layer_times(sizes[len(sizes) // 2]),
                                       args.stages)])
    for balance in balances:
        if len(balance) != args.stages:
            raise UserError(f"--balance {','.join(map(str, balance))} has {len(balance)} "
                            f"stages, --stages is {args.stages}")
    job = functools.partial(builtin_job, args.model, args.batch_size, dtype=args.dtype,
                            **parse_sizes(args.set))
    try:
        module = job()[0]
    except (TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"model {args.model!r}: {exc}") from None
    for balance in balances:
        if len(module) != profile.n_layers or sum(balance) != profile.n_layers:
            raise UserError(f"{flag} {path} has {profile.n_layers} layers, model "
                            f"{args.model!r} {len(module)}, --balance {list(balance)} sums to "
                            f"{sum(balance)}: profile the same model (`pipesim profile`)")
    return profile, balances, job, sizes


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine's cluster for ``--stages`` workers and write the Cluster JSON
    that ``simulate``, ``tune`` and ``run --cluster`` take: CPU processes
    (:func:`_calibrate_processes`) or the threads of one process on one device
    (:func:`_calibrate_threads`)."""
    import torch

    if args.stages < 2:
        raise UserError(f"--stages {args.stages}: a pipeline's workers are 2 or more")
    cores = thread_cores(args)
    if args.transport == "threads":
        check_device(args.device)
        for flag, given in (("--pin", args.pin), ("--idle-at-once", args.idle_at_once)):
            if given:
                raise UserError(f"{flag} is for --transport processes")
        if args.idle_costs and args.stage_costs:
            raise UserError("--idle-costs and --stage-costs: one or the other (the idle costs "
                            "are read against the profile, which the stage costs replace)")
        if args.idle_costs and args.device != "cpu":
            raise UserError(f"--idle-costs with --device {args.device}: measured and checked "
                            "for stage threads on the CPU only (on a GPU: --stage-costs)")
    else:
        if args.stage_costs:
            raise UserError("--stage-costs is for --transport threads (processes measure "
                            "their stages in place with --idle-costs PROFILE)")
        if args.device != "cpu":
            raise UserError(f"--device {args.device}: the processes transport runs on the CPU "
                            "(stages on a GPU: --transport threads)")
    if args.balance and not (args.idle_costs or args.stage_costs):
        raise UserError(f"--balance {' '.join(args.balance)}: the balance measured in place, "
                        "with --idle-costs or --stage-costs PROFILE")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    calibrate = _calibrate_threads if args.transport == "threads" else _calibrate_processes
    with threads_on(cores):  # (threads on --cores: the cluster's workers take turns there)
        cluster = calibrate(args)
    path = cluster.save(args.out)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s; wrote {path} "
          f"(pipesim simulate/tune/run --cluster {path})")
    return 0


def _calibrate_threads(args: argparse.Namespace) -> Cluster:
    """The in-process executor's cluster on ``--device`` (:func:`executor.calibrate.
    calibrate_threads`) and, with ``--stage-costs PROFILE``, each stage of each
    ``--balance`` measured in place there, plain and checkpointed at the profile's sizes
    (:func:`executor.in_place.device_stage_costs`): the seconds those plans' actions cost
    (:class:`pipesim.readings.InPlaceCost`).  On the H200 grid they took the median error
    from 7.3% to 4.9% (``experiments/README.md``)."""
    from executor.calibrate import calibrate_threads, overheads_text
    from executor.in_place import device_stage_costs
    from pipesim.costs import profile_seconds
    from pipesim.readings import in_place_costs_of

    inputs = (_in_place_inputs(args, args.stage_costs, "--stage-costs")
              if args.stage_costs else None)
    waits = (_in_place_inputs(args, args.idle_costs, "--idle-costs")
             if args.idle_costs else None)
    print(f"calibrating {args.stages} threads on {args.device} ...", flush=True)
    cluster = calibrate_threads(args.device, args.stages)
    print(f"  {overheads_text(cluster)}", flush=True)
    if waits is not None:
        return _with_thread_idle_costs(args, cluster, *waits)
    if inputs is None:
        return cluster
    profile, balances, job, sizes = inputs
    lacking = threads_profile_warning(profile, args.stage_costs, args.device, args.stages)
    if lacking:
        print(f"pipesim: warning: {lacking}", file=sys.stderr)
    rows: list[dict] = []
    for balance in balances:
        print(f"each stage of balance {list(balance)} in place at {sizes} samples ...",
              flush=True)
        measured = device_stage_costs(job, balance, sizes, device=args.device,
                                      rounds=args.in_place_rounds)
        rows += measured
        firsts = stage_firsts(balance)
        for r in sorted(measured, key=lambda r: (r["first"], r["checkpointed"],
                                                 r["micro_batch"])):
            alone = profile_seconds(profile, cluster, list(balance), r["micro_batch"],
                                    r["checkpointed"])[firsts.index(r["first"])]
            print(f"  stage {firsts.index(r['first'])} {r['micro_batch']} samples"
                  f"{' checkpointed' if r['checkpointed'] else ''}: forward "
                  f"{r['fwd_s'] * 1e3:.3f} ms (profile {alone[0] * 1e3:.3f}), backward "
                  f"{r['bwd_s'] * 1e3:.3f} ms (profile {alone[1] * 1e3:.3f})")
    listed = ", ".join(str(list(b)) for b in balances)
    print(f"  (plans of balance {listed} cost what was measured; other balances the profile's)")
    return dataclasses.replace(cluster, in_place_costs=in_place_costs_of(rows))


def _calibrate_processes(args: argparse.Namespace) -> Cluster:
    """Links, the executor's overheads and the host contention of ``--stages`` CPU
    processes and, with ``--idle-costs PROFILE``, what a wait costs each stage of each
    ``--balance`` (:func:`executor.in_place.idle_costs`), read against that profile, what
    checkpointing adds to each stage's backward (:func:`executor.in_place.
    checkpoint_extras`), its own executor seconds between actions
    (:class:`pipesim.readings.ExecutorGap`) and how much its stages slow each other
    computing at once (:func:`executor.in_place.stage_contention`: an action pays the
    larger of it and the host contention; over 45 grids of this project's VM, 2.00% /
    14.1% -> 1.95% / 9.8% pooled)."""
    from executor.calibrate import calibrate_cpu, calibration_executor_gap, overheads_text
    from executor.in_place import (
        IDLE_SIZES,
        checkpoint_extras_of,
        executor_gaps_of,
        idle_costs,
        spread_sizes,
        stage_contention,
        stage_costs,
    )
    from pipesim.costs import with_profile_seconds

    inputs = (_in_place_inputs(args, args.idle_costs, "--idle-costs")
              if args.idle_costs else None)
    print(f"calibrating {args.stages} processes ...", flush=True)
    cluster = calibrate_cpu(args.stages, threads_per_rank=args.threads, pin_cores=args.pin)
    print(f"  link {cluster.link.latency_s * 1e6:.0f} us + bytes / "
          f"{cluster.link.bandwidth_Bps / 1e9:.2f} GB/s; {overheads_text(cluster)}; host "
          f"contention {cluster.host_contention:.2f}", flush=True)
    if inputs is None:
        return cluster
    profile, balances, job, sizes = inputs
    # (each stage's executor seconds read against the calibration pipeline's own, which
    # calibrate_cpu measures)
    base = cluster.executor_gap_base_s or calibration_executor_gap(pin_cores=args.pin)
    waits: list[IdleCost] = []
    extras: list[CheckpointExtra] = []
    gaps: list[ExecutorGap] = []
    slowdowns: list[SpanSlowdown] = []
    for balance in balances:
        print(f"idle costs of balance {list(balance)} at {spread_sizes(sizes, IDLE_SIZES)} "
              f"samples ({'every rank at once' if args.idle_at_once else 'one rank at a time'})"
              " ...", flush=True)
        rows = with_profile_seconds(idle_costs(job, balance, sizes, rounds=args.idle_rounds,
                                               threads=args.threads, pin_cores=args.pin,
                                               at_once=args.idle_at_once),
                                    profile, cluster, balance)
        _print_idle_costs(rows, balance)
        # and what checkpointing adds to each stage's backward, where no idle curve reads
        # it in place (the last stage's), and each stage's own executor seconds between
        # actions: one in-place measurement of the stages
        stages = stage_costs(job, balance, sizes, threads=args.threads, pin_cores=args.pin)
        added, own = checkpoint_extras_of(stages), executor_gaps_of(stages)
        _print_checkpoint_extras(added, balance)
        firsts = stage_firsts(balance)
        print(f"  executor's own seconds around an action (calibration pipeline's "
              f"{base * 1e3:.3f} ms): " + "  ".join(
                  f"stage {firsts.index(x.first)} {x.micro_batch} samples "
                  f"{x.seconds * 1e3:.3f} ms" for x in own if not x.checkpointed))
        # and how much the stages slow each other computing at once (their memory
        # traffic): an action pays the larger of it and the host contention
        slow = stage_contention(job, balance, sizes, repeats=args.contention_repeats,
                                threads=args.threads, pin_cores=args.pin)
        _print_slowdowns(slow, balance)
        waits += _unmeasured(rows, waits)
        extras += _unmeasured(added, extras)
        gaps += _unmeasured(own, gaps)
        slowdowns += _unmeasured(slow, slowdowns)
    listed = ", ".join(str(list(b)) for b in balances)
    print(f"  (plans of balance {listed} pay them; other balances predict without)")
    return dataclasses.replace(cluster, idle_costs=tuple(waits), checkpoint_extras=tuple(extras),
                               executor_gaps=tuple(gaps), executor_gap_base_s=base,
                               host_slowdowns=tuple(slowdowns))


def _with_thread_idle_costs(args: argparse.Namespace, cluster: Cluster, profile: Profile,
                            balances: list[list[int]], job: Callable,
                            sizes: list[int]) -> Cluster:
    """``cluster`` (stage threads on the CPU) with what a wait costs each stage of each
    balance in ``balances`` and what checkpointing adds to its backward, both measured in
    this process (:func:`executor.in_place.idle_costs` with ``device``, the checkpoint's
    extras from :func:`executor.in_place.device_stage_costs`), the idle costs read against
    ``profile``.  On this project's VM they took the CPU threads grid from 14.8-29.8% median
    error to 7.9-19.9% in six runs (2026-11-26, ``validate_threads.py``)."""
    from executor.in_place import (
        IDLE_SIZES,
        checkpoint_extras_of,
        device_stage_costs,
        idle_costs,
        spread_sizes,
    )
    from pipesim.costs import with_profile_seconds

    waits: list[IdleCost] = []
    extras: list[CheckpointExtra] = []
    for balance in balances:
        print(f"idle costs of balance {list(balance)} at {spread_sizes(sizes, IDLE_SIZES)} "
              "samples, each stage in this process ...", flush=True)
        rows = with_profile_seconds(idle_costs(job, balance, sizes, rounds=args.idle_rounds,
                                               device=args.device), profile, cluster, balance)
        _print_idle_costs(rows, balance)
        added = checkpoint_extras_of(device_stage_costs(job, balance, sizes, device=args.device,
                                                        rounds=args.in_place_rounds))
        _print_checkpoint_extras(added, balance)
        waits += _unmeasured(rows, waits)
        extras += _unmeasured(added, extras)
    listed = ", ".join(str(list(b)) for b in balances)
    print(f"  (plans of balance {listed} pay them; other balances predict without)")
    return dataclasses.replace(cluster, idle_costs=tuple(waits), checkpoint_extras=tuple(extras))


def _unmeasured(rows: Sequence[Spanned], have: Sequence[Spanned]) -> list[Spanned]:
    """``rows`` of the layer spans none of ``have`` is of: a stage two balances share
    (``--balance tuned``) keeps its first balance's reading."""
    spans = {(x.first, x.stop) for x in have}
    return [x for x in rows if (x.first, x.stop) not in spans]


def _print_idle_costs(rows: Sequence[IdleCost], balance: list[int]) -> None:
    """Each stage's and action's seconds more after each idle (the median over sizes)."""
    firsts = stage_firsts(balance)
    spans = _grouped(rows, lambda r: (r.first, r.kind, r.checkpointed))
    for (first, kind, ckpt), part in sorted(spans.items()):
        extra = "  ".join(f"{idle * 1e3:g} ms: {statistics.median(x.seconds for x in r) * 1e3:+.2f}"
                          for idle, r in sorted(_grouped(part, lambda r: r.idle_s).items()))
        # ("FB": a forward right after a backward that waited the idle)
        what = "F after a B" if kind == "FB" else kind
        print(f"  stage {firsts.index(first)} {what}{' checkpointed' if ckpt else ''}, "
              f"seconds more after an idle of {extra} ms")


def _print_per_size(rows: Sequence[Spanned], balance: list[int], what: str,
                    value: Callable[[Spanned], str]) -> None:
    """One line per stage of ``balance``: ``what``, then each size's ``value(row)``."""
    firsts = stage_firsts(balance)
    for (first, _), part in sorted(_grouped(rows, lambda r: (r.first, r.stop)).items()):
        print(f"  stage {firsts.index(first)} {what}: " + "  ".join(
            f"{x.micro_batch} samples {value(x)}" for x in sorted(part, key=lambda x: x.micro_batch)))


def _print_slowdowns(slowdowns: Sequence[SpanSlowdown], balance: list[int]) -> None:
    """Each stage's slowdown beside the other ranks computing, per size."""
    _print_per_size(slowdowns, balance, "beside the others computing",
                    lambda x: f"x{x.slowdown:.2f}")


def _print_checkpoint_extras(extras: Sequence[CheckpointExtra], balance: list[int]) -> None:
    """What checkpointing adds to each stage's backward, per size."""
    _print_per_size(extras, balance, "B checkpointed, seconds more than plain",
                    lambda x: f"{x.seconds * 1e3:+.2f} ms")


def _grouped(rows, key) -> dict:
    """``rows`` in lists by ``key(row)``, in their order."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's cluster (CPU processes, or "
                       "threads on one device)",
                       description="Measure the executor's cluster on this machine and write a "
                       "Cluster JSON for simulate, tune and run --cluster. --transport "
                       "processes (default): the links, the executor's overheads and the host "
                       "contention of --stages CPU processes (about 20 s), and with --idle-costs "
                       "what a wait costs each stage's actions (minutes). --transport threads: "
                       "the overheads of --stages stage threads on --device (a GPU, or the "
                       "CPU), and with --stage-costs each stage of each --balance measured in "
                       "place there.")
    add_model_options(p)
    p.add_argument("--transport", default="processes", choices=["processes", "threads"],
                   help="one process per stage (CPU, default), or threads of one process "
                   "(`run --transport threads`)")
    p.add_argument("--device", default="cpu",
                   help="the threads' device: cpu or cuda[:N] (default cpu)")
    p.add_argument("--stages", type=positive_int, default=2, help="workers (default 2)")
    p.add_argument("--pin", action="store_true",
                   help="each process on its own cores, as `run --transport processes --pin`")
    add_cores_option(p)
    p.add_argument("--idle-costs", metavar="PROFILE",
                   help="also measure idle costs and the checkpoint's extras in place, read "
                   "against this profile of --model (taken on this machine: `pipesim "
                   "profile`): in each rank for processes (and how much the stages slow "
                   "each other computing at once), in this process for threads on the CPU")
    p.add_argument("--stage-costs", metavar="PROFILE",
                   help="threads: also measure each stage of --balance in place on --device, "
                   "plain and checkpointed at this profile's sizes (taken there: `pipesim "
                   "profile --device ...`); plans of that balance cost what was measured")
    p.add_argument("--balance", action="append", metavar="BALANCE",
                   help="the balance whose stages are measured in place (default: "
                   "time-balanced from the profile); repeat it for several, or `tuned` for "
                   "every balance `pipesim tune` tries at --batch-size (its candidates then "
                   "priced alike)")
    p.add_argument("--batch-size", type=positive_int, default=32,
                   help="samples per iteration: the largest micro-batch measured in place "
                   "(default 32)")
    p.add_argument("--idle-rounds", type=positive_int, default=10,
                   help="rounds of the idle-cost measurement (default 10)")
    p.add_argument("--idle-at-once", action="store_true",
                   help="every rank measures its idle costs at the same time (a core per rank "
                   "and more; see executor.in_place.idle_costs)")
    p.add_argument("--contention-repeats", type=positive_int, default=3,
                   help="readings of each balance's in-place contention, the median kept "
                   "(default 3: one reading in a slow spell reads a whole layout high)")
    p.add_argument("--in-place-rounds", type=positive_int, default=5,
                   help="rounds of the --stage-costs measurement (default 5)")
    p.add_argument("--out", default="out/cluster.json", help="cluster JSON path")
    p.set_defaults(func=cmd_calibrate)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(extra=(add_profile, add_run, add_calibrate, add_demo)), argv)


if __name__ == "__main__":
    sys.exit(main())
