"""Tensor parallelism's pieces that know nothing of the engine nor of the models: the collectives (group.py),
where ranks meet (rendezvous.py) and how they watch each other (liveness.py). Imports torch alone, nothing
of nanostream's: the layers and the models build on it.

How the decoder splits over the ranks is the decoder's own (models/sharding.py); the processes themselves
are the engine's: engine/tp/workers.py (rank 0's side), engine/tp/worker.py (the others).
"""

from nanostream.distributed.group import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
