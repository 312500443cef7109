"""What the host allocator costs a pipeline stage: page faults with glibc's default policy
against memory kept by the process (:mod:`executor.host_allocator`), side by side.

For each model of ``experiments/validate.py`` (batch 32, one thread) a fresh process runs
the whole model's forward (its activations kept, as a stage keeps them until its backward)
and then the backward, ``--iterations`` times, and reports per pass the wall time and the
minor page faults (``getrusage``: pages the kernel had to hand over and zero).  Each policy
runs in its own processes, alternated over ``--rounds`` rounds; medians over iterations and
rounds.

    python experiments/host_allocator.py [--models mlp,gpt,unet] [--rounds 3]
Writes experiments/results/host_allocator.csv (+ .json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd

from executor.host_allocator import DEFAULT, ENV, RETAIN
from experiments.common import machine, write_results

#: run in a fresh process: MODEL ITERATIONS -> one JSON line of per-iteration rows
_PASSES = r"""
import json, resource, sys, time, torch
from executor.host_allocator import retain_freed_memory
from executor.models import builtin_job
from experiments.validate import BATCH, MODELS
policy = retain_freed_memory()
torch.set_num_threads(1)
name, iterations = sys.argv[1], int(sys.argv[2])
module, loss_fn, x, y = builtin_job(name, BATCH, **MODELS[name])
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rows = []
for i in range(iterations):
    f0, t0 = faults(), time.perf_counter()
    loss = loss_fn(module(x), y)
    f1, t1 = faults(), time.perf_counter()
    loss.backward()
    f2, t2 = faults(), time.perf_counter()
    del loss
    module.zero_grad(set_to_none=True)
    rows.append({"iteration": i, "fwd_s": t1 - t0, "bwd_s": t2 - t1,
                 "fwd_faults": f1 - f0, "bwd_faults": f2 - f1})
print(json.dumps({"policy": policy, "rows": rows}))
"""


def passes(model: str, policy: str, iterations: int) -> tuple[str, list[dict]]:
    """``(policy in force, per-iteration rows)`` of one fresh process."""
    out = subprocess.run([sys.executable, "-c", _PASSES, model, str(iterations)],
                         env={**os.environ, ENV: policy, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["policy"], result["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,unet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=12, help="passes a process (2 warm-up)")
    args = ap.parse_args()
    rows, policies = [], {}
    for model in args.models.split(","):
        for r in range(args.rounds):
            for policy in (DEFAULT, RETAIN):
                policies[policy], its = passes(model, policy, args.iterations)
                rows += [{"model": model, "policy": policy, "round": r, **it} for it in its[2:]]
    raw = pd.DataFrame(rows)
    table = (raw.groupby(["model", "policy"])
             .agg(fwd_ms=("fwd_s", lambda s: 1e3 * statistics.median(s)),
                  bwd_ms=("bwd_s", lambda s: 1e3 * statistics.median(s)),
                  fwd_faults=("fwd_faults", "median"), bwd_faults=("bwd_faults", "median"),
                  fwd_ms_max=("fwd_s", lambda s: 1e3 * max(s)),
                  bwd_ms_max=("bwd_s", lambda s: 1e3 * max(s)))
             .reset_index())
    step = table.fwd_ms + table.bwd_ms
    retained = table[table.policy == RETAIN].set_index("model")
    table["step_vs_retain"] = step.values / (retained.fwd_ms + retained.bwd_ms).reindex(
        table.model).values
    print(table.round(3).to_string(index=False))
    write_results("host_allocator", table, {**machine(), "policies_in_force": policies,
                                            "rounds": args.rounds,
                                            "iterations": args.iterations,
                                            "command": "python experiments/host_allocator.py"})


if __name__ == "__main__":
    main()
