"""A step launched on the device and not yet read back (``InFlight``), and what rank 0's runner asks of the
other ranks while it runs one (``StepControl``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from nanostream.engine.runner.pooled import Pooled
from nanostream.engine.runner.prompt_logprobs import PromptLogprobs
from nanostream.engine.runner.sampler import SamplerOutput, SamplingBatch
from nanostream.engine.sequence import Sequence

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from nanostream.engine.runner.step_inputs import Chunk
    from nanostream.errors import EngineDeadError


@dataclass
class InFlight:
    """A launched step whose samples are still on the device."""

    seqs: list[Sequence]  # the sequences that sample, in row order
    rows: dict[str, int]  # request id -> row of ``out``
    out: SamplerOutput | None  # on the device (the next step reads pending tokens from it); None: no samples
    host: SamplerOutput | None = None  # the same, being copied into pinned host memory
    copied: torch.cuda.Event | None = None  # recorded after those copies (CUDA only)
    # Launched with sampling deferred (``sample()`` runs it): the logits [B, V] and their sampling batch.
    logits: torch.Tensor | None = None
    batch: SamplingBatch | None = None
    prompt_logprobs: PromptLogprobs | None = None  # of the chunks whose requests ask for them
    pooled: Pooled | None = None  # the embeddings of the sequences that ask for them


class StepControl(Protocol):
    """What rank 0's runner asks of the other ranks (engine/tp/workers.py's ``WorkerGroup``): ``step`` publishes
    a step that this rank runs inside (a failure: ``EngineDeadError``); ``dead``, the engine's death of ``exc``."""

    def step(self, chunks: list[Chunk]) -> AbstractContextManager[None]: ...
    def dead(self, exc: BaseException) -> EngineDeadError: ...


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
