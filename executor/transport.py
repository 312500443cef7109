"""Moving activations and gradients between stages.

Both transports have the same calls, so one stage runner drives either:

* ``send(tensor, dst_stage, kind, mb)`` -- never blocks the sender's compute for long;
* ``recv(stage, kind, mb)`` -- blocks until that input (``kind='F'``) or gradient
  (``kind='B'``) of ``stage`` arrived, raising :class:`PipelineAborted` if another worker
  failed or :class:`TimeoutError` after ``timeout_s``: nothing waits forever;
* ``prefetch(stage, kind, mb)`` -- says a ``recv`` of that message comes next, so a
  transport that can post the receive early does (its bytes then land while this
  worker computes, instead of after it asked).

:class:`ThreadTransport` hands tensors between worker threads of one process (CUDA: the
copy runs on a side stream and the receiver's stream waits on an event);
:class:`DistTransport` uses torch.distributed point-to-point ``isend``/``irecv`` (gloo on
CPU) between one process per rank.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8]
_HEADER = 12  # int64 slots: dtype code, ndim, up to 10 sizes


def _work(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point op (None only for ranks outside the group)."""
    if work is None:
        raise RuntimeError("this rank is not in the process group of the transfer")
    return work


class PipelineAborted(RuntimeError):
    """Another worker failed; this one stops instead of waiting."""


class Transport:
    """What every transport shares: ``prefetch`` does nothing unless it can post early."""

    def prefetch(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> None:
        """Nothing to post: the message is at hand when it is sent."""


class ThreadTransport(Transport):
    """In-process mailbox between worker threads; see the module docstring."""

    def __init__(self, devices: list[torch.device], placement: tuple[int, ...],
                 timeout_s: float = 300.0):
        self.devices, self.placement, self.timeout_s = devices, placement, timeout_s
        self._box: dict[tuple[int, str, int], tuple[torch.Tensor, object]] = {}
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.received: list[tuple[int, str, int]] = []  # every key received, in order
        self._copy_streams: dict[tuple[str, str], torch.cuda.Stream] = {}

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def _copy_stream(self, src: torch.device, dst: torch.device) -> torch.cuda.Stream:
        key = (str(src), str(dst))
        if key not in self._copy_streams:
            self._copy_streams[key] = torch.cuda.Stream(src)
        return self._copy_streams[key]

    def send(self, tensor: torch.Tensor, dst_stage: int, kind: str, mb: int,
             src_stage: int | None = None) -> None:
        del src_stage  # hand-overs and device copies are not logged as transfers
        dst = self.devices[self.placement[dst_stage]]
        ready = None
        if tensor.is_cuda or dst.type == "cuda":
            produced = torch.cuda.current_stream(tensor.device).record_event() if tensor.is_cuda else None
            if tensor.device != dst:
                # Copy on a side stream so the sender's compute stream runs on.
                stream = self._copy_stream(tensor.device if tensor.is_cuda else dst, dst)
                with torch.cuda.stream(stream):
                    if produced is not None:
                        stream.wait_event(produced)
                    moved = tensor.to(dst, non_blocking=True)
                    if tensor.is_cuda:
                        tensor.record_stream(stream)
                    ready = stream.record_event()
                tensor = moved
            else:
                ready = produced
        with self._cond:
            self._box[(dst_stage, kind, mb)] = (tensor, ready)
            self._cond.notify_all()

    def recv(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> torch.Tensor:
        del src_stage  # the mailbox is keyed by the receiver
        key = (stage, kind, mb)
        self.received.append(key)
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._box:
                if self.error is not None:
                    raise PipelineAborted(f"stopped waiting for {stage}{kind}{mb}: another worker "
                                          "failed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {'input' if kind == 'F' else 'gradient'} for stage "
                                       f"{stage}, micro-batch {mb} within {self.timeout_s:.0f} s")
                self._cond.wait(min(left, 0.5))
            tensor, ready = self._box.pop(key)
        if isinstance(ready, torch.cuda.Event):
            if tensor.is_cuda:  # the receiver's stream waits for the copy, not its host
                stream = torch.cuda.current_stream(tensor.device)
                stream.wait_event(ready)
                tensor.record_stream(stream)
            else:  # copied to a CPU worker: the host waits for the copy to land
                ready.synchronize()
        return tensor

    def finish_iteration(self) -> None:
        with self._cond:
            leftover = sorted(self._box)
            self._box.clear()
        if leftover:
            raise RuntimeError(f"messages never received: {leftover[:5]}")


Key = tuple[int, str, int]  # (receiving stage, kind, micro-batch)


def message_group(groups: tuple[Any, Any], src: int, dst: int) -> Any:
    """The group of ``groups`` = ``(up, down)`` that carries messages from rank ``src`` to
    rank ``dst``: ``up`` towards a higher rank, ``down`` towards a lower one."""
    return groups[0] if src < dst else groups[1]


class DistTransport(Transport):
    """Point-to-point between ranks with torch.distributed (one process per rank).

    Shapes travel in a small header the first time each (stage, kind, micro-batch) is
    sent; later iterations reuse them (a shape that changes is refused, naming the
    message).  Messages between two ranks are told apart in one of two ways:

    * ``tags=True`` (gloo): each message carries a tag built from its key, so the
      receiver may take them in any order;
    * ``tags=False`` (NCCL, which ignores tags): the receiver takes each peer's messages
      in the order that peer sends them -- ``send_order[peer]``, worked out from the
      schedule -- and keeps the ones that arrive before they are needed.

    Sent tensors are kept until the sends are waited for at the end of the iteration
    (gloo reports completion only then).

    ``groups`` = ``(up, down)``: messages to a higher rank go over ``up``, to a lower rank
    over ``down`` (:func:`executor.distributed.directional_groups`: with gloo, a TCP
    connection per direction): two ranks that send to each other at once -- a 1F1B
    stage's forward output crossing its neighbour's gradient -- then do not share one
    connection (why, measured: :func:`executor.distributed.directional_groups`).
    """

    def __init__(self, rank: int, placement: tuple[int, ...], n_microbatches: int,
                 device: torch.device, timeout_s: float = 120.0, skip_names: tuple[str, ...] = (),
                 *, tags: bool = True, send_order: dict[int, list[Key]] | None = None,
                 groups: tuple[Any, Any] = (None, None)):
        if not tags and send_order is None:
            raise ValueError("without tags the receiver needs each peer's send order")
        # (to higher ranks, to lower ranks): a process group per direction (None: the
        # default group), see executor.distributed.directional_groups
        self.groups = groups
        self.tags, self.send_order = tags, send_order or {}
        self._next: dict[int, int] = {}  # peer -> index of its next message in send_order
        self._early: dict[Key, torch.Tensor] = {}  # arrived before they were asked for
        self.rank, self.placement, self.m = rank, placement, n_microbatches
        # message kinds, in an order every rank agrees on: tags are built from it
        self.kinds = ["F", "B"] + [f"{p}:{n}" for n in sorted(skip_names) for p in ("S", "SB")]
        self.device, self.timeout = device, timedelta(seconds=timeout_s)
        self._shapes: dict[tuple[int, str, int], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._local: dict[tuple[int, str, int], torch.Tensor] = {}  # stages on this rank
        self._posted: dict[Key, tuple[dist.Work, torch.Tensor]] = {}  # receives posted early
        self.sent_bytes = 0
        # message log for measured transfer rows: ("post", key, src_stage, t, nbytes, src,
        # dst) at the sender, ("done", key, t) at the receiver; perf_counter seconds
        self.log: list[tuple] = []

    def _tag(self, stage: int, kind: str, mb: int) -> int:
        if not self.tags:
            return 0
        return (stage * self.m + mb) * len(self.kinds) + self.kinds.index(kind)

    def _group(self, src: int, dst: int) -> Any:
        """The process group of messages from rank ``src`` to rank ``dst``."""
        return message_group(self.groups, src, dst)

    def _peer(self, stage: int, kind: str, src_stage: int | None) -> int:
        """Rank that sends (stage, kind): the neighbour stage's, or ``src_stage``'s."""
        if src_stage is not None:
            return self.placement[src_stage]
        return self.placement[stage - 1] if kind == "F" else self.placement[stage + 1]

    def send(self, tensor: torch.Tensor, dst_stage: int, kind: str, mb: int,
             src_stage: int | None = None) -> None:
        dst = self.placement[dst_stage]
        key = (dst_stage, kind, mb)
        if dst == self.rank:
            self._local[key] = tensor
            return
        tag = self._tag(dst_stage, kind, mb)
        tensor = tensor.contiguous()
        known = self._shapes.get(key)
        if known is not None and known != (tensor.dtype, tuple(tensor.shape)):
            raise ValueError(f"rank {self.rank}: message {dst_stage}{kind}{mb} was "
                             f"{known[0]} {list(known[1])} before and is {tensor.dtype} "
                             f"{list(tensor.shape)} now: shapes must not change between "
                             "iterations (they travel once)")
        if key not in self._shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = _DTYPES.index(tensor.dtype)
            header[1] = tensor.dim()
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
            header = header.to(self.device)
            self._pending.append((_work(dist.isend(header, dst, tag=tag,
                                                      group=self._group(self.rank, dst))),
                                   header))
            self._shapes[key] = (tensor.dtype, tuple(tensor.shape))
        nbytes = tensor.numel() * tensor.element_size()
        self.log.append(("post", key, src_stage, time.perf_counter(), nbytes, self.rank, dst))
        self._pending.append((_work(dist.isend(tensor, dst, tag=tag,
                                              group=self._group(self.rank, dst))), tensor))
        self.sent_bytes += nbytes

    def recv(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> torch.Tensor:
        src = self._peer(stage, kind, src_stage)
        key = (stage, kind, mb)
        if src == self.rank:
            return self._local.pop(key)
        if self.tags:
            return self._receive(src, key)
        # in the peer's send order, keeping what comes early
        while key not in self._early:
            order = self.send_order.get(src, [])
            i = self._next.get(src, 0)
            if i >= len(order):
                raise RuntimeError(f"rank {self.rank}: {stage}{kind}{mb} is not among the messages "
                                   f"rank {src} sends (send order exhausted)")
            self._next[src] = i + 1
            self._early[order[i]] = self._receive(src, order[i])
        return self._early.pop(key)

    def prefetch(self, stage: int, kind: str, mb: int, src_stage: int | None = None) -> None:
        """Post the receive of a message the next action needs (with tags, once its shape
        is known: from the second iteration on), as torch's runtime posts its receives
        ahead; the buffer then exists from now, not from the message's arrival."""
        if not self.tags:
            return  # received in send order (see recv): posting ahead could break it
        src = self._peer(stage, kind, src_stage)
        key = (stage, kind, mb)
        if src == self.rank or key in self._posted or key not in self._shapes:
            return
        dtype, shape = self._shapes[key]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._posted[key] = (_work(dist.irecv(buf, src, tag=self._tag(*key),
                                               group=self._group(src, self.rank))), buf)

    def _receive(self, src: int, key: Key) -> torch.Tensor:
        tag = self._tag(*key)
        posted = self._posted.pop(key, None)
        if posted is not None:
            work, buf = posted
            self._wait(work, key)
            self.log.append(("done", key, time.perf_counter()))
            return buf
        if key not in self._shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            self._wait(_work(dist.irecv(header, src, tag=tag, group=self._group(src, self.rank))),
                       key)
            header = header.cpu()
            ndim = int(header[1])
            self._shapes[key] = (_DTYPES[int(header[0])], tuple(int(x) for x in header[2:2 + ndim]))
        dtype, shape = self._shapes[key]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(_work(dist.irecv(buf, src, tag=tag, group=self._group(src, self.rank))), key)
        self.log.append(("done", key, time.perf_counter()))
        return buf

    def _wait(self, work: dist.Work, key: tuple[int, str, int]) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            stage, kind, mb = key
            raise TimeoutError(f"rank {self.rank}: receiving {stage}{kind}{mb} failed or timed out "
                               f"({exc})") from None

    def finish_iteration(self) -> None:
        for work, _ in self._pending:
            work.wait(self.timeout)
        self._pending.clear()
        self._next.clear()
        if self._posted:
            raise RuntimeError(f"rank {self.rank}: receives posted but never used: "
                               f"{sorted(self._posted)[:5]}")
        if self._early:
            raise RuntimeError(f"rank {self.rank}: messages received but never used: "
                               f"{sorted(self._early)[:5]}")
