"""A torchgpipe-style facade for users coming from the seed library.

    model = GPipe(nn.Sequential(...), balance=[2, 2], devices=["cpu", "cpu"], chunks=4)
    loss = model.train_step(inputs, targets)      # pipelined forward+backward, grads in .grad
    out = model(inputs)                           # pipelined inference forward

Input checks follow torchgpipe's contract: a module that is not ``nn.Sequential`` is a
TypeError; a missing balance, one not summing to the module's length, non-positive
entries, ``chunks < 1``, an unknown checkpoint mode or schedule are ValueErrors; fewer
devices than partitions is an IndexError.  ``deferred_batch_norm=True`` replaces every
BatchNorm by :class:`executor.batchnorm.DeferredBatchNorm` (running statistics as one
full batch), as torchgpipe's option does.  Layers pass one tensor to the next: a layer
that returns a tuple is refused at the first step with the layer named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from executor.batchnorm import DeferredBatchNorm
from executor.partition import split_module
from executor.pipeline import Pipeline
from executor.stage import ActionFailed
from pipesim.plan import CHECKPOINT_MODES, Plan
from pipesim.schedule import SCHEDULES


class GPipe(nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential`` (see the module docstring)."""

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None,
                 devices: Sequence[str | torch.device] | None = None, chunks: int = 1,
                 checkpoint: str = "except_last", schedule: str = "gpipe",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 deferred_batch_norm: bool = False):
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be nn.Sequential to be partitioned, got "
                            f"{type(module).__name__}")
        if balance is None:
            raise ValueError("balance is required: give the number of layers of each partition")
        balance = [int(b) for b in balance]
        if sum(balance) != len(module):
            raise ValueError(f"module and sum of balance have different length "
                             f"(module: {len(module)}, sum of balance: {sum(balance)})")
        if any(b <= 0 for b in balance):
            raise ValueError(f"all balance numbers must be positive integer (balance: {balance})")
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"number of chunks must be positive integer, got {chunks!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint is not one of {', '.join(repr(m) for m in CHECKPOINT_MODES)}"
                             f": {checkpoint!r}")
        if schedule not in SCHEDULES or schedule == "interleaved":
            usable = sorted(k for k in SCHEDULES if k != "interleaved")
            raise ValueError(f"schedule must be one of {usable} (one stage per device), got "
                             f"{schedule!r}")
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module)  # in place: a Sequential stays itself
        if devices is None:
            n_gpu = torch.cuda.device_count()
            devices = ([f"cuda:{i}" for i in range(n_gpu)] if n_gpu >= len(balance)
                       else ["cpu"] * len(balance))
        devices = [torch.device(d) for d in devices]
        if len(devices) < len(balance):
            raise IndexError(f"too few devices to hold given partitions (devices: {len(devices)}, "
                             f"partitions: {len(balance)})")
        self.module, self.balance, self.chunks = module, balance, chunks
        self.checkpoint, self.schedule = checkpoint, schedule
        self.devices = devices[: len(balance)]
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.partitions = nn.ModuleList(split_module(module, balance))
        for partition, device in zip(self.partitions, self.devices, strict=True):
            partition.to(device)
        self._pipelines: dict[int, Pipeline] = {}

    def plan(self, batch_size: int) -> Plan:
        """The Plan this facade runs for a batch of ``batch_size`` samples."""
        return Plan(self.balance, min(self.chunks, batch_size), batch_size,
                    checkpoint=self.checkpoint, schedule=self.schedule)

    def _pipeline(self, batch_size: int) -> Pipeline:
        if batch_size not in self._pipelines:
            self._pipelines[batch_size] = Pipeline(self.module, self.plan(batch_size), self.devices,
                                                   self.loss_fn)
        return self._pipelines[batch_size]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Pipelined forward and backward of one batch; returns its mean loss.

        Gradients accumulate into the parameters' ``.grad`` exactly as one full-batch
        ``loss_fn(module(inputs), targets).backward()`` would; step your optimizer after.
        """
        try:
            _, loss, _ = self._pipeline(inputs.shape[0]).step(inputs, targets)
        except ActionFailed as exc:
            if "tuple" in str(exc) and "object has no attribute" in str(exc):
                raise TypeError(f"{exc}: pipesim passes one tensor between layers; a layer that "
                                "returns a tuple must be split or wrapped") from exc
            raise
        return loss

    def close(self) -> None:
        """Stop the pipelines' worker threads (also done when the facade is collected)."""
        for pipe in self._pipelines.values():
            pipe.close()

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Pipelined inference: micro-batches flow through the partitions in clock order.

        In clock cycle k, micro-batch m runs on partition k - m; on CUDA the partitions'
        kernels overlap because launches are asynchronous.  Output on the last device.
        """
        chunks = list(inputs.chunk(min(self.chunks, inputs.shape[0])))
        n, m = len(self.partitions), len(chunks)
        for clock in range(m + n - 1):
            for j in range(max(0, clock - n + 1), min(clock + 1, m)):
                p = clock - j
                out = self.partitions[p](chunks[j].to(self.devices[p], non_blocking=True))
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"partition {p} returned {type(out).__name__}, not a tensor: "
                                    "pipesim passes one tensor between layers")
                chunks[j] = out
        return torch.cat(chunks)
