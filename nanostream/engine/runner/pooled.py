"""Embeddings: an embedding request's prompt pooled into one vector (models/pooling.py says how), in the
step that computes its prompt's last token, beside the step's other requests, and read back with its
samples; the request's delta carries it (float32 bytes; clients normalise and cut it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanostream.engine.sequence import Sequence


@dataclass
class Pooled:
    """One step's embeddings, on the device until ``read``."""

    seqs: list[Sequence]
    vectors: torch.Tensor  # [P, H] float32: the final (normed) hidden state of each one's last prompt token

    def read(self) -> None:
        for seq, vector in zip(self.seqs, self.vectors.cpu()):
            seq.embedding = vector.numpy().tobytes()


def launch_pooling(seqs: list[Sequence], hidden: torch.Tensor) -> Pooled | None:
    """The embeddings of the ``seqs`` that ask (hidden: [len(seqs), H], each one's last computed token,
    which for a request that samples its first token is its prompt's last). None when none asks."""
    rows = [i for i, s in enumerate(seqs) if s.params.embed]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
    return Pooled([seqs[i] for i in rows], hidden.index_select(0, index).float())
