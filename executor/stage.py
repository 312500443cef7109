"""The stage runner: executes one worker's action list for the stages it holds.

For every action of the Schedule assigned to this worker:

    F(s, m):  x = micro-batch m (stage 0) or recv(s, F, m), detached into a leaf
              y = stage_s(x)            (inside torch.utils.checkpoint if m is checkpointed)
              last stage: loss_m = loss_fn(y, target_m) * |m| / batch  -> stash
              otherwise:  send(y, s+1)                                 -> stash (x, y)
    B(s, m):  backward(loss_m) on the last stage, else backward(y, recv(s, B, m))
              send(x.grad, s-1)

Stage boundaries are detached, so each stage back-propagates on its own worker; the
weighted micro-batch losses add up to the full batch's mean loss and the gradients
accumulate to exactly the full batch's.  Skip connections crossing stages
(:mod:`executor.skip`) are sent straight from the stashing to the popping stage after the
forward, and their gradients straight back after the popping stage's backward; the
stashing stage's backward then runs from its output and its stashed tensors together.
Memory is measured around the runner, not by it (:mod:`executor.memtrack`).
Checkpointing preserves the random state, so dropout in the recomputation draws the
first forward's masks.  Threads of one process share one random generator: where a
worker's stages use dropout, its forwards and checkpointed backwards hold ``rng_lock`` so
no other thread draws in between.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from executor.batchnorm import recomputing
from executor.microbatch import loss_weight
from executor.partition import has_dropout
from executor.recorder import Recorder
from executor.skip import SkipTracker, arrive, use_tracker
from executor.transport import PipelineAborted
from pipesim.plan import Plan
from pipesim.schedule import FORWARD, Action


class ActionFailed(RuntimeError):
    """An action raised; the message names the worker, stage and action."""


class StageRunner:
    """Runs one worker's actions; see the module docstring."""

    def __init__(self, worker: int, stages: Mapping[int, nn.Module], plan: Plan,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, transport, recorder: Recorder,
                 rng_lock: threading.Lock | None = None,
                 fail_at: str | None = None,
                 skips: tuple[tuple[str, int, int], ...] = ()):
        self.worker, self.stages, self.plan, self.loss_fn = worker, stages, plan, loss_fn
        self.device, self.transport, self.recorder = device, transport, recorder
        self.last = plan.n_stages - 1
        random = any(has_dropout(m) for m in stages.values())
        self.rng_lock = rng_lock if (random and rng_lock is not None) else None
        self.fail_at = fail_at
        self.stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # skips crossing stages: (name, stashing stage, popping stage)
        self.skips_in = {st: [(n, a) for n, a, b in skips if b == st] for st in stages}
        self.skips_out = {st: [(n, b) for n, a, b in skips if a == st] for st in stages}
        self._skip_state: dict[tuple[int, int], dict] = {}
        self.losses: dict[int, float] = {}

    def _locked(self):
        return self.rng_lock if self.rng_lock is not None else contextlib.nullcontext()

    def run(self, actions: tuple[Action, ...], inputs: list[torch.Tensor] | None,
            targets: list[torch.Tensor] | None) -> None:
        """Execute ``actions`` in order; any error becomes :class:`ActionFailed`."""
        for action in actions:
            try:
                if self.fail_at is not None and str(action) == self.fail_at:
                    raise RuntimeError("injected failure")
                if action.kind == FORWARD:
                    self.forward(action.stage, action.microbatch, inputs, targets)
                else:
                    self.backward(action.stage, action.microbatch)
            except PipelineAborted:
                raise  # another worker failed first: its error is the one to report
            except Exception as exc:
                raise ActionFailed(f"worker {self.worker} failed at stage {action.stage} action "
                                   f"{action}: {type(exc).__name__}: {exc}") from exc

    def forward(self, s: int, m: int, inputs, targets) -> None:
        if s == 0:
            x = inputs[m]
        else:
            x = self.transport.recv(s, "F", m).detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        module: Callable[[torch.Tensor], torch.Tensor] = self.stages[s]
        if self.skips_in[s] or self.skips_out[s] or self.plan.checkpointed(m):
            module = self._wrap(s, m, module)
        rec = self.recorder
        rec.start(s, m, "F")
        with self._locked():
            if self.plan.checkpointed(m):
                out = checkpoint(module, x, use_reentrant=False, preserve_rng_state=True)
            else:
                out = module(x)
            y = self.loss_fn(out, targets[m]) * loss_weight(self.plan, m) if s == self.last else out
        rec.stop(s, m, "F")
        self.stash[(s, m)] = (x, y)
        if s == self.last:
            self.losses[m] = float(y.detach())
        else:
            self.transport.send(y.detach(), s + 1, "F", m, src_stage=s)
        state = self._skip_state.get((s, m))
        if state is not None and (self.skips_in[s] or self.skips_out[s]):
            tracker = state["tracker"]
            tracker.closed = True
            for name, dst in self.skips_out[s]:
                # straight to the popping stage, not through the stages between
                self.transport.send(tracker.stashed[name].detach(), dst, f"S:{name}", m,
                                    src_stage=s)
            state["out"] = [tracker.stashed.pop(name) for name, _ in self.skips_out[s]]
            if not self.plan.checkpointed(m):
                # nothing to recompute: received skips die once their consumers are done
                tracker.tensors.clear()

    def _wrap(self, s: int, m: int, module: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        """``module`` run under this micro-batch's skip tracker, its second and later calls
        marked as recomputations (deferred batch norm skips them) -- in whatever thread
        calls it: a recomputation may run on autograd's thread.  A recomputation is
        recorded as an ``R`` interval inside its backward, as the simulator draws it."""
        tracker = SkipTracker(retain=True)
        # name -> (gradient box, shape, dtype, device): no tensor kept here
        boxes: dict[str, tuple[list, torch.Size, torch.dtype, torch.device]] = {}
        for name, src in self.skips_in[s]:
            t = self.transport.recv(s, f"S:{name}", m, src_stage=src).detach()
            if t.is_floating_point():
                boxes[name] = ([], t.shape, t.dtype, t.device)
                t = arrive(t, boxes[name][0])
            tracker.tensors[name] = t
        self._skip_state[(s, m)] = {"tracker": tracker, "boxes": boxes, "out": []}
        calls = [0]

        def run(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            again = calls[0] > 1
            if not again:
                with use_tracker(tracker):
                    return module(x)
            self.recorder.start(s, m, "R")
            try:
                with use_tracker(tracker), recomputing(True):
                    return module(x)
            finally:  # the checkpoint stops a recomputation early by raising inside it
                self.recorder.stop(s, m, "R")

        return run

    def backward(self, s: int, m: int) -> None:
        x, y = self.stash.pop((s, m))
        grad = None if s == self.last else self.transport.recv(s, "B", m)
        state = self._skip_state.pop((s, m), None)
        outputs, grads = [y], [grad]
        if state is not None and self.skips_out[s]:
            for (name, dst), t in zip(self.skips_out[s], state["out"], strict=True):
                outputs.append(t)
                grads.append(self.transport.recv(s, f"SB:{name}", m, src_stage=dst))
        rec = self.recorder
        rec.start(s, m, "B")
        with self._locked() if self.plan.checkpointed(m) else contextlib.nullcontext():
            if len(outputs) == 1:
                torch.autograd.backward(y, grad)
            else:
                torch.autograd.backward(outputs, grads)
        rec.stop(s, m, "B")
        if state is not None and self.skips_in[s]:
            for name, src in self.skips_in[s]:
                box, shape, dtype, device = state["boxes"][name]
                g = sum(box) if box else torch.zeros(shape, dtype=dtype, device=device)
                self.transport.send(g, src, f"SB:{name}", m, src_stage=s)
            state.clear()
        del y, grad
        if s > 0:
            if x.grad is None:
                raise RuntimeError(f"stage {s} input got no gradient; does stage {s - 1}'s output "
                                   "feed it differentiably?")
            self.transport.send(x.grad, s - 1, "B", m, src_stage=s)
