"""Simulator speed: median time per simulation next to a bare SimPy pipeline loop.

For (stages, micro-batches) in (4, 8), (8, 32), (16, 64), (32, 128): a GPipe plan on a
uniform profile with memory tracking and CPU-process links (so transfers are simulated),
timed end to end (schedule build and check, cost lookup, SimPy run, trace frames), and
its SimPy run alone.  The bare loop is the least a SimPy pipeline can do: one process
per stage, one timeout per action, one event per dependency, no bookkeeping.

Then the zero-bubble schedules at 8 ranks x 32 micro-batches (ZB-H1, and ZBV on 16
half-size stages), end to end: the list scheduler that builds the order, its check, the
simulation with memory and links.

    python experiments/bench_simulator.py [--repeats 15]
Targets: 8 x 32 GPipe with memory tracking at most 10 ms and at most 2x the bare loop;
ZBV 8 x 32 at most 50 ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd
import simpy

from experiments.common import machine, median_seconds, write_results
from pipesim.cluster import Cluster
from pipesim.plan import Plan
from pipesim.profile import synthetic_profile as uniform_profile
from pipesim.simulator import Simulator, _Run, simulate

SIZES = [(4, 8), (8, 32), (16, 64), (32, 128)]


def bare_loop(n: int, m: int, f: float = 1.0, b: float = 2.0) -> float:
    """GPipe with n stages and m micro-batches in plain SimPy; returns the makespan."""
    env = simpy.Environment()
    fwd = [[env.event() for _ in range(m)] for _ in range(n)]
    bwd = [[env.event() for _ in range(m)] for _ in range(n)]

    def stage(s):
        for k in range(m):
            if s > 0:
                yield fwd[s - 1][k]
            yield env.timeout(f)
            fwd[s][k].succeed()
        for k in reversed(range(m)):
            if s < n - 1:
                yield bwd[s + 1][k]
            yield env.timeout(b)
            bwd[s][k].succeed()

    for s in range(n):
        env.process(stage(s))
    env.run()
    return env.now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = []
    for n, m in SIZES:
        prof = uniform_profile(n, sizes=(1, 2))
        plan = Plan([1] * n, m, m, checkpoint="never", schedule="gpipe")
        reps = max(3, args.repeats * 32 // (n * m) if n * m > 256 else args.repeats)
        for links in ("cpu", "free"):
            cluster = Cluster.cpu_processes(n) if links == "cpu" else Cluster.free(n)
            total = median_seconds(lambda p=prof, pl=plan, c=cluster: simulate(p, pl, c), reps)
            sim = Simulator(prof, plan, cluster)
            run_only = median_seconds(lambda s=sim: _Run(s, 0, 0.0, None).run(), reps)
            bare = median_seconds(lambda n=n, m=m: bare_loop(n, m), reps)
            actions = 2 * n * m
            rows.append({"stages": n, "microbatches": m, "links": links, "actions": actions,
                         "simulate_ms": total * 1e3, "simpy_run_ms": run_only * 1e3,
                         "bare_loop_ms": bare * 1e3, "actions_per_s": actions / total,
                         "ratio_vs_bare": total / bare, "run_ratio_vs_bare": run_only / bare})
            print(f"{n:3d} x {m:4d} {links:4s}: simulate {total * 1e3:8.2f} ms  "
                  f"(SimPy run {run_only * 1e3:7.2f} ms)  bare {bare * 1e3:7.2f} ms  "
                  f"ratio {total / bare:4.2f}x", flush=True)
    for name, v in (("zb-h1", 1), ("zbv", 2)):
        n, m = 8 * v, 32
        prof = uniform_profile(n, sizes=(1, 2))
        plan = Plan([1] * n, m, m, checkpoint="never", schedule=name, virtual_stages=v)
        cluster = Cluster.cpu_processes(8)
        total = median_seconds(lambda p=prof, pl=plan, c=cluster: simulate(p, pl, c),
                               max(3, args.repeats // 3))
        rows.append({"stages": n, "microbatches": m, "links": "cpu", "schedule": name,
                     "actions": 3 * n * m, "simulate_ms": total * 1e3,
                     "actions_per_s": 3 * n * m / total})
        print(f"{name} 8 ranks x {m}: build, check and simulate {total * 1e3:8.2f} ms", flush=True)
    table = pd.DataFrame(rows)
    table["schedule"] = table.get("schedule", pd.Series(dtype=object)).fillna("gpipe")
    path = write_results("bench_simulator", table, {**machine(), "repeats": args.repeats,
                                                     "simpy": simpy.__version__})
    print(table.round(3).to_string(index=False))
    target = table[(table.stages == 8) & (table.links == "cpu")].iloc[0]
    zbv = table[table.schedule == "zbv"].iloc[0]
    print(f"8x32 GPipe with memory and links: {target.simulate_ms:.2f} ms (target <= 10), "
          f"{target.ratio_vs_bare:.2f}x the bare loop (target <= 2); ZBV 8x32: "
          f"{zbv.simulate_ms:.2f} ms (target <= 50); wrote {path}")


if __name__ == "__main__":
    main()
