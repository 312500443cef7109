"""The same plans run with an executor option off and on, side by side.

The multi-process executor (2 ranks, gloo) runs the plans in rounds that alternate the
option off and on (which goes first alternating too), so the machine's load of a moment
weighs on both alike.  Per plan and
setting: the median iteration and its spread (p90 / p10), and how long the step's
messages took from their post to their receipt (median over messages, and the share of
iterations whose median message took over 1 ms).  Options (``--option``):

* ``pin_cores``: ranks pinned to their own cores (:func:`executor.distributed.rank_cores`)
  against placement left to the operating system.  Seen on this project's 2-core VM
  (2026-11-24, 2 rounds of 8 iterations; medians, unpinned -> pinned): the median message
  0.27-2.6 ms -> 0.14-0.60 ms (GPipe U-Net, whose forward messages wait for a busy
  receiver, 2.6 -> 1.7), steps with a slow message 6-94% -> 0-69%; iterations U-Net 1F1B
  [8,5] at 16 micro-batches 94.6 -> 81.1 ms, at 4 46.9 -> 50.3, GPipe 79.6 -> 69.3; MLP
  1F1B [4,4] at 16 40.4 -> 33.6, GPipe [1,7] 44.5 -> 44.9; GPT 1F1B [3,3] at 8 75.1 -> 69.5.
* ``directional``: messages up and down over a process group each
  (:func:`executor.distributed.directional_groups`) against one group for both, ranks
  pinned.  Figures in ``pipesim/MODEL.md`` ("Messages that cross").
* ``prefetch_after_inputs``: a rank posts its next action's receives once its current
  action's inputs are in (:meth:`executor.stage.StageRunner._inputs_in`, the default since
  2026-11-27) against before waiting for them, ranks pinned.  Also per plan: the inputs
  that came after their receiver was ready with their sender computing, their mean transit
  (``transit_ms``) and the share over 1 ms.
* ``receives_at_start``: a rank posts every receive of its step as the step starts
  (:meth:`executor.stage.StageRunner.run`, the default since 2026-11-30) against action
  by action (once the action before has its inputs), ranks pinned.  Seen on this
  project's VM (2026-11-30 02:54, 3 rounds of 12 iterations; medians, off -> on), every
  plan faster: MLP GPipe [4,4] at 16 micro-batches 43.1 -> 37.1 ms (the median message
  2.0 -> 1.1 ms, steps with a slow one 75% -> 42%), GPipe [1,7] 64.1 -> 57.4 (1.4 -> 0.26
  ms), 1F1B [4,4] 51.2 -> 47.5; U-Net GPipe [8,5] 81.2 -> 67.3, 1F1B 74.5 -> 65.2, at 4
  micro-batches 57.3 -> 49.4; GPT 1F1B [3,3] at 8 87.8 -> 84.6.  An earlier reading of
  the hour, 3 rounds with a window of four receives ahead beside them, alike (MLP GPipe
  [4,4] 38.3 -> 28.9, the window 34.0; 1F1B [4,4] 38.8 -> 31.7, GPT GPipe [3,3] at 16
  87.8 -> 87.1).

    python experiments/executor_options.py [--option pin_cores] [--rounds 2] [--iterations 8]
Writes experiments/results/OPTION.csv (``pinning.csv`` for pin_cores; one row per plan,
setting and round) and .json.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from executor.distributed import spawn_plans
from executor.models import builtin_job
from experiments.common import machine, write_results
from experiments.phase_errors import message_transits
from experiments.validate import BATCH, MODELS
from pipesim.plan import Plan

#: per model, plans of the CPU grid whose steps exchange many messages
PLANS = {"unet": [("1f1b", [8, 5], 16), ("1f1b", [8, 5], 4), ("gpipe", [8, 5], 16)],
         "mlp": [("1f1b", [4, 4], 16), ("gpipe", [1, 7], 16), ("gpipe", [4, 4], 16)],
         "gpt": [("1f1b", [3, 3], 8)]}


#: per option: its spawn_plans keyword, the results' name, the options always set
OPTIONS = {"pin_cores": ("pin_cores", "pinning", {}),
           "directional": ("directional", "directional", {"pin_cores": True}),
           "prefetch_after_inputs": ("prefetch_after_inputs", "prefetch_after_inputs",
                                     {"pin_cores": True, "receives_at_start": False}),
           "receives_at_start": ("receives_at_start", "receives_at_start",
                                 {"pin_cores": True})}


def _row(model: str, plan: Plan, actions: pd.DataFrame, option: str, on: bool,
         rnd: int) -> dict:
    steps = actions.groupby("iteration")
    iteration = steps.apply(lambda g: g.end.max() - g.start.min())
    sends = actions[actions.kind.str.startswith("SEND")]
    per_step = (sends.end - sends.start).groupby(sends.iteration).median()
    # the inputs that came after their receiver was ready, their sender computing by then
    # (experiments/phase_errors.py): the stalls of receives posted as a message streams in
    parts = [t for it, part in steps if it > 0 and len(t := message_transits(part))]
    busy = (pd.concat(parts, ignore_index=True).query("sender_computing").transit_s
            if parts else pd.Series(dtype=float))
    return {"model": model, "plan": plan.label(), option: on, "round": rnd,
            "iteration_ms": 1e3 * float(iteration.median()),
            "spread": float(iteration.quantile(0.9) / iteration.quantile(0.1)),
            "message_ms": 1e3 * float((sends.end - sends.start).median()),
            "slow_message_steps": float((per_step > 1e-3).mean()),
            "transit_ms": 1e3 * float(busy.mean()) if len(busy) else 0.0,
            "transits_over_1ms": float((busy > 1e-3).mean()) if len(busy) else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--option", choices=sorted(OPTIONS), default="pin_cores")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=8)
    args = ap.parse_args()
    keyword, name, fixed = OPTIONS[args.option]
    rows = []
    for rnd in range(args.rounds):
        for model, specs in PLANS.items():
            job = functools.partial(builtin_job, model, BATCH, **MODELS[model])
            plans = [Plan(balance, chunks, BATCH, checkpoint="never", schedule=schedule)
                     for schedule, balance, chunks in specs]
            # (off first in even rounds, on first in odd ones: no setting always second)
            for on in ((False, True) if rnd % 2 == 0 else (True, False)):
                runs = spawn_plans(job, plans, iterations=args.iterations, warmup=2,
                                   **{**fixed, keyword: on})
                for plan, (result, _) in zip(plans, runs, strict=True):
                    rows.append(_row(model, plan, result.trace.actions, keyword, on, rnd))
                    print(rows[-1], flush=True)
                table = pd.DataFrame(rows)
                write_results(name, table, {**machine(), "option": keyword, "fixed": fixed,
                                            "rounds": args.rounds,
                                            "iterations": args.iterations})
    summary = (table.groupby(["model", "plan", keyword])
               [["iteration_ms", "spread", "message_ms", "slow_message_steps", "transit_ms",
                 "transits_over_1ms"]].median())
    with pd.option_context("display.width", 160):
        print(summary.round(3).to_string())


if __name__ == "__main__":
    main()
