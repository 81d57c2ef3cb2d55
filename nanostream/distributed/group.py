"""``TensorParallel``: one process's place among an engine's ranks, and the only collectives they run.

Two process groups over one ``torch.distributed`` store, made for this engine alone (no default group,
no process-wide registry: two engines in one process, or a program that runs torch.distributed itself,
never share one):

- ``compute``: NCCL on CUDA, gloo on CPU. Per layer two all-reduces (after o_proj and down_proj) and one
  for the embedding; per step one gather of the logits to rank 0 and one broadcast of rank 0's samples
  (the next step's inputs where it decodes).
- ``control``: gloo on the CPU, whatever the device. Rank 0 broadcasts each step's description on it
  (``publish``); the other ranks wait there (``receive``) for as long as the engine idles.

``SINGLE`` (size 1) has no groups and runs none of them: a single GPU runs exactly what it did before.
"""

from __future__ import annotations

import datetime
import struct

import torch
import torch.distributed as dist

COMPUTE_TIMEOUT = datetime.timedelta(minutes=10)
"""Longest a collective of the model waits for the other ranks (they do the same work in lockstep, so this
bounds only a peer that hangs where no heartbeat can tell: a worker on another host)."""
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
"""Workers wait on the control group while the engine idles, however long that is; a dead rank 0 closes
its sockets, which ends the wait at once."""
FRAME_BYTES = 16 << 10
"""A control message goes in one fixed-size broadcast (8 bytes of length, then the message) when it fits,
as a decode step's does; a longer one (a long prompt's chunk) sends the rest in a second broadcast."""
_HEADER = struct.Struct("<q")
_FROM_FIRST = dist.BroadcastOptions()
_FROM_FIRST.rootRank = 0


class TensorParallel:
    """Rank ``rank`` of ``size``; ``local_rank`` is its index on its host (its GPU)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        compute: dist.ProcessGroup | None = None,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.compute, self.control = compute, control
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8) if size > 1 else None  # the control frame

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, local_rank: int, device: torch.device) -> TensorParallel:
        """Build both groups; blocks until every rank has called this with the same store."""
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
        compute_store = dist.PrefixStore("compute", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COMPUTE_TIMEOUT
            compute = dist.ProcessGroupNCCL(compute_store, rank, size, options)
        else:
            compute = dist.ProcessGroupGloo(compute_store, rank, size, COMPUTE_TIMEOUT)
        return cls(rank, size, local_rank, compute, control)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # ---- the model's collectives (compute group) -------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same bits."""
        self.compute.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` side by side along the last dimension; other ranks: None."""
        # x: [B, V / size] -> [B, V] on rank 0
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_first else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.compute.gather(parts, [x.contiguous()], options).wait()
        return torch.cat(parts[0], dim=-1) if self.is_first else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype on each)."""
        self.compute.broadcast([x], _FROM_FIRST).wait()
        return x

    # ---- the control group ----------------------------------------------------------------------

    def publish(self, message: bytes) -> None:
        """Rank 0: send ``message`` to every other rank (each is in ``receive``)."""
        frame, n, first = self._frame, len(message), FRAME_BYTES - _HEADER.size
        frame[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(n)), dtype=torch.uint8)
        if n:
            frame[_HEADER.size : _HEADER.size + min(n, first)] = torch.frombuffer(
                bytearray(message[:first]), dtype=torch.uint8
            )
        self.control.broadcast([frame], _FROM_FIRST).wait()
        if n > first:
            self.control.broadcast(
                [torch.frombuffer(bytearray(message[first:]), dtype=torch.uint8)], _FROM_FIRST
            ).wait()

    def receive(self) -> bytes:
        """Ranks > 0: the next message rank 0 publishes (waits for it however long)."""
        frame, first = self._frame, FRAME_BYTES - _HEADER.size
        self.control.broadcast([frame], _FROM_FIRST).wait()
        (n,) = _HEADER.unpack(frame[: _HEADER.size].numpy().tobytes())
        head = frame[_HEADER.size : _HEADER.size + min(n, first)].numpy().tobytes()
        if n <= first:
            return head
        rest = torch.empty(n - first, dtype=torch.uint8)
        self.control.broadcast([rest], _FROM_FIRST).wait()
        return head + rest.numpy().tobytes()

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (the KV blocks every rank has room for)."""
        x = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([x], options).wait()
        return int(x.item())

    def abort(self) -> None:
        """Make collectives stuck on a dead peer fail, where the backend can (NCCL; gloo fails on its own
        once the peer's sockets close)."""
        if self.compute is not None and self.compute.name() == "nccl":
            self.compute.abort()


SINGLE = TensorParallel()
"""One rank: no groups, no collectives."""
