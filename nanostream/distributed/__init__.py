"""Tensor parallelism's pieces that know nothing of the engine: how the decoder splits (sharding.py),
the collectives (group.py), where ranks meet (rendezvous.py) and how they watch each other (liveness.py).

The processes themselves are the engine's: engine/tp/workers.py (rank 0's side), engine/tp/worker.py (the others).
"""

from nanostream.distributed.group import SINGLE, TensorParallel
from nanostream.distributed.sharding import DecoderShard, check_split, shard_decoder

__all__ = ["SINGLE", "DecoderShard", "TensorParallel", "check_split", "shard_decoder"]
