"""The stage runner: executes one worker's action list for the stages it holds.

For every action of the Schedule assigned to this worker:

    F(s, m):  x = micro-batch m (stage 0) or recv(s, F, m), detached into a leaf
              y = stage_s(x)            (inside torch.utils.checkpoint if m is checkpointed)
              last stage: loss_m = loss_fn(y, target_m) * |m| / batch  -> stash
              otherwise:  send(y, s+1)                                 -> stash (x, y)
    B(s, m):  backward(loss_m) on the last stage, else backward(y, recv(s, B, m))
              send(x.grad, s-1)

A split backward (the schedule has I and W for (s, m) instead of B) cuts the stage's
backward inside autograd's graph (:mod:`executor.split_backward`):

    I(s, m):  (checkpointed: re-run F now, with the random state of the first F)
              send(gradient of x, s-1), keeping the graph and the gradients W needs
    W(s, m):  the weight gradients from those; then the micro-batch's graph goes

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

from executor import split_backward
from executor.batchnorm import recomputing
from executor.microbatch import loss_weight
from executor.partition import has_dropout
from executor.recorder import Recorder
from executor.skip import SkipTracker, arrive, use_tracker
from executor.transport import PipelineAborted
from pipesim.plan import Plan
from pipesim.schedule import BACKWARD, FORWARD, GRADIENT_KINDS, INPUT_GRAD, WEIGHT_GRAD, Action


class ActionFailed(RuntimeError):
    """An action raised; the message names the worker, stage and action."""


class StageRunner:
    """Runs one worker's actions; see the module docstring."""

    def __init__(self, worker: int, stages: Mapping[int, nn.Module], plan: Plan,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, transport, recorder: Recorder,
                 rng_lock: threading.Lock | None = None,
                 fail_at: str | None = None,
                 skips: tuple[tuple[str, int, int], ...] = (),
                 prefetch_after_inputs: bool = True, receives_at_start: bool = True):
        self.worker, self.stages, self.plan, self.loss_fn = worker, stages, plan, loss_fn
        # post the next action's receives once this one's inputs are in (see _inputs_in);
        # False: before waiting for them
        self.prefetch_after_inputs = prefetch_after_inputs
        # post every receive of the step as it starts (see run); False: action by action
        self.receives_at_start = receives_at_start
        self._prefetch_next: Action | None = None
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
        # split backwards: (stage, micro-batch) -> what I needs, then what W needs
        self._split: set[tuple[int, int]] = set()
        self._split_state: dict[tuple[int, int], _SplitState] = {}

    def _locked(self):
        return self.rng_lock if self.rng_lock is not None else contextlib.nullcontext()

    def run(self, actions: tuple[Action, ...], inputs: list[torch.Tensor] | None,
            targets: list[torch.Tensor] | None) -> None:
        """Execute ``actions`` in order; any error becomes :class:`ActionFailed`.

        With ``receives_at_start`` every receive the actions will make is posted first
        (where the transport posts ahead: gloo, from a step on whose shapes it knows), so
        that no message waits for its receive: over gloo a message sent before its receive
        is posted is written later by the sender's I/O thread, which shares the sender's
        core with its compute -- in GPipe's forward phase, with the sender computing
        forward after forward, for milliseconds.  Side by side on this project's VM
        (``experiments/executor_options.py --option receives_at_start``, 2026-11-30, off
        -> on, medians): MLP GPipe [4,4] at 16 micro-batches 43.1 -> 37.1 ms an iteration
        (median message 2.0 -> 1.1 ms), GPipe [1,7] 64.1 -> 57.4, 1F1B [4,4] 51.2 -> 47.5,
        U-Net GPipe [8,5] 81.2 -> 67.3, GPT 1F1B [3,3] at 8 87.8 -> 84.6: every plan
        tried faster.  Every receive buffer then exists from the step's start
        (:attr:`pipesim.cluster.Cluster.receives_at_start`).
        """
        self._split = {(a.stage, a.microbatch) for a in actions if a.kind == INPUT_GRAD}
        if self.receives_at_start:
            for action in actions:
                self._prefetch(action)
        for i, action in enumerate(actions):
            try:
                key = (action.stage, action.microbatch)
                # the next action's input may land meanwhile (posted already where every
                # receive went at the start: a transport posts only what it knows the shape
                # of, which the step's first receive of each message teaches it)
                if i + 1 < len(actions) and not self.receives_at_start:
                    if (self.prefetch_after_inputs and key not in self._split
                            and action.kind in (FORWARD, BACKWARD)):
                        self._prefetch_next = actions[i + 1]  # once this one's are in
                    else:
                        self._prefetch(actions[i + 1])
                if self.fail_at is not None and str(action) == self.fail_at:
                    raise RuntimeError("injected failure")
                if action.kind == FORWARD and key in self._split:
                    self.forward_split(action.stage, action.microbatch, inputs, targets)
                elif action.kind == FORWARD:
                    self.forward(action.stage, action.microbatch, inputs, targets)
                elif action.kind == INPUT_GRAD:
                    self.input_grad(action.stage, action.microbatch, targets)
                elif action.kind == WEIGHT_GRAD:
                    self.weight_grad(action.stage, action.microbatch)
                else:
                    self.backward(action.stage, action.microbatch)
            except PipelineAborted:
                raise  # another worker failed first: its error is the one to report
            except Exception as exc:
                raise ActionFailed(f"worker {self.worker} failed at stage {action.stage} action "
                                   f"{action}: {type(exc).__name__}: {exc}") from exc

    def _inputs_in(self) -> None:
        """This action's inputs are in (its compute comes next): post the receives of the
        next action now, not before waiting for this one's.  A receive posted on a gloo
        connection while a message streams in on it stalls that message, at times for
        milliseconds: two pinned ranks, the receiver posting its next receives as 2 x 128
        KiB come, 31-32% of them over 1 ms and 4.1-4.2 ms at the 90th percentile, against
        0-1% and 0.2 ms where it waits (``experiments/send_then_compute.py``, ``next``,
        2026-11-27) -- what GPipe's last stage did at every forward, its next forward's
        receives posted as stage 0's output and skip came."""
        if self._prefetch_next is not None:
            action, self._prefetch_next = self._prefetch_next, None
            self._prefetch(action)

    def _prefetch(self, action: Action) -> None:
        """Post the receives ``action`` will make: its input or gradient, and the skip
        tensors (or their gradients) it takes straight from another stage.  A large message
        only streams once its receive is posted, so a late post puts the whole transfer on
        the critical path."""
        s, kind, m = action
        if kind == FORWARD:
            if s > 0:
                self.transport.prefetch(s, "F", m)
            for name, src in self.skips_in.get(s, ()):
                self.transport.prefetch(s, f"S:{name}", m, src_stage=src)
        elif kind in GRADIENT_KINDS:
            if s < self.last:
                self.transport.prefetch(s, "B", m)
            for name, dst in self.skips_out.get(s, ()):
                self.transport.prefetch(s, f"SB:{name}", m, src_stage=dst)

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
        self._inputs_in()
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
        self._inputs_in()
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

    # ------------------------------------------------------------ split backward
    def _forward_graph(self, s: int, m: int, x: torch.Tensor, targets) -> torch.Tensor:
        out = self.stages[s](x)
        return self.loss_fn(out, targets[m]) * loss_weight(self.plan, m) if s == self.last else out

    def forward_split(self, s: int, m: int, inputs, targets) -> None:
        x = inputs[m] if s == 0 else self.transport.recv(s, "F", m).detach()
        if s > 0 and x.is_floating_point():
            x.requires_grad_(True)
        ckpt = self.plan.checkpointed(m)
        state = _SplitState(x)
        rec = self.recorder
        rec.start(s, m, "F")
        with self._locked():
            if ckpt:  # keep the input and the random state; I re-runs the forward
                state.rng = _rng_state(self.device)
                with torch.no_grad():
                    y = self._forward_graph(s, m, x, targets)
            else:
                y = state.y = self._forward_graph(s, m, x, targets)
        rec.stop(s, m, "F")
        if s == self.last:
            self.losses[m] = float(y.detach())
        else:
            self.transport.send(y.detach(), s + 1, "F", m, src_stage=s)
        self._split_state[(s, m)] = state

    def input_grad(self, s: int, m: int, targets) -> None:
        state = self._split_state[(s, m)]
        grad = None if s == self.last else self.transport.recv(s, "B", m)
        rec = self.recorder
        rec.start(s, m, "I")
        if state.rng is not None:  # checkpointed: the forward again, with the first masks
            rec.start(s, m, "R")
            with self._locked(), recomputing(True), _rng_restored(state.rng, self.device):
                state.x = state.x.detach().requires_grad_(state.x.requires_grad)
                state.y = self._forward_graph(s, m, state.x, targets)
            rec.stop(s, m, "R")
        y = state.y
        assert y is not None
        inputs = [state.x] if s > 0 and state.x.requires_grad else []
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        grads, state.work = split_backward.input_grad(y, grad, inputs, params)
        rec.stop(s, m, "I")
        del y, grad
        state.y = None  # the graph lives on in what W needs
        if s > 0:
            if not grads or grads[0] is None:
                raise RuntimeError(f"stage {s} input got no gradient; does stage {s - 1}'s output "
                                   "feed it differentiably?")
            self.transport.send(grads[0], s - 1, "B", m, src_stage=s)

    def weight_grad(self, s: int, m: int) -> None:
        state = self._split_state.pop((s, m))
        rec = self.recorder
        rec.start(s, m, "W")
        split_backward.weight_grad(state.work)
        rec.stop(s, m, "W")


class _SplitState:
    """One micro-batch of one stage between its F, I and W (see the module docstring)."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.y: torch.Tensor | None = None
        self.work = split_backward.WeightWork()
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a forward starts from (CPU, and the device's when CUDA)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """Run with the random state of ``state``, and give the current one back after."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
