"""Where an engine's ranks meet: a ``torch.distributed`` store, found through torchrun's variables.

On one host the engine hosts the store itself on a port the OS picks (``host_locally``) and hands its
workers the variables torchrun would have set; across hosts torchrun (or the user) sets them::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 LOCAL_RANK=0 nanostream serve MODEL ...

Rank 0 is the engine. The variables are read only where a process starts (``from_env`` is called by
``nanostream serve`` and the worker's entry point), never by a library constructor.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off: on a shared host (a GPU slice of a bigger machine) setting it up fails or hangs."""
STORE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others to reach the store (another host may start later)."""
_NAMESPACE = "nanostream"  # the keys' prefix in a store torchrun shares with others


@dataclass(frozen=True)
class Rendezvous:
    """One rank's view of the meeting point, as torchrun describes it."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int = 0
    agent_store: bool = False
    """torchrun's agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``): rank 0 connects to it too."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}; give 0 <= RANK < WORLD_SIZE")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT={self.master_port} is not a TCP port")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Rendezvous | None:
        """The rendezvous torchrun's variables describe; None when WORLD_SIZE is unset or 1."""
        if environ.get("WORLD_SIZE", "1") in ("", "1"):
            return None
        missing = [name for name in TORCHRUN_VARIABLES[:4] if not environ.get(name)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={environ['WORLD_SIZE']} is set but {', '.join(missing)} is not: set all of "
                f"{', '.join(TORCHRUN_VARIABLES)} (torchrun does), or none for one process"
            )
        try:
            port, world, rank = (int(environ[k]) for k in ("MASTER_PORT", "WORLD_SIZE", "RANK"))
            local_rank = int(environ.get("LOCAL_RANK", "0"))
        except ValueError as exc:
            raise ValueError(f"MASTER_PORT, WORLD_SIZE, RANK and LOCAL_RANK must be integers: {exc}") from None
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return cls(environ["MASTER_ADDR"], port, world, rank, local_rank, agent)

    def for_rank(self, rank: int) -> Rendezvous:
        """The same meeting point as seen by ``rank`` on this host."""
        return dataclasses.replace(self, rank=rank, local_rank=rank)

    def environment(self) -> dict[str, str]:
        """torchrun's variables for a process of this rank."""
        values = (self.master_addr, self.master_port, self.world_size, self.rank, self.local_rank)
        return dict(zip(TORCHRUN_VARIABLES, map(str, values)))

    def connect(self) -> dist.Store:
        """This rank's client of the store (rank 0 hosts it unless torchrun's agent does)."""
        store = dist.TCPStore(
            self.master_addr,
            self.master_port,
            self.world_size,
            is_master=self.rank == 0 and not self.agent_store,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
        )
        return dist.PrefixStore(_NAMESPACE, store)


def host_locally(world_size: int) -> tuple[Rendezvous, dist.Store]:
    """A store on a free loopback port of this host (the OS picks it: two engines never collide), and the
    rendezvous of rank 0 on it."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    return Rendezvous("127.0.0.1", store.port, world_size, 0), dist.PrefixStore(_NAMESPACE, store)


def with_multicast_off(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with NVLink multicast switched off, except where it already says otherwise."""
    return {**MULTICAST_OFF, **environ}


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank with ``local_rank`` on its host: ``cuda[:k]`` -> ``cuda:{k + local_rank}``."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + local_rank}"
