"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the top N.

A request that asks for them gets no prefix-cache hits until they are all computed
(``Sequence.wants_prompt_logprobs``), so every prompt position runs through the model; a chunk of its
prompt gives the logprobs of the tokens after each of its positions. They are computed on the device
in the step that runs the chunk and read back with its samples; the request's first delta carries them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanostream.engine.runner.step_inputs import Chunk, Uploads, to_device
from nanostream.engine.sequence import Sequence

_ROWS_PER_PASS = 1024  # logits [rows, V] in float32 at a time: a long prompt never holds all of its [T, V]


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs, on the device until ``read``."""

    spans: list[tuple[Sequence, int, int]]  # (sequence, first token index, count), in row order
    logprobs: torch.Tensor  # [R] float32: of each next prompt token
    top_ids: torch.Tensor  # [R, N] int64
    top_logprobs: torch.Tensor  # [R, N] float32

    def read(self) -> None:
        """Append each span's logprobs to its sequence (positions it has already are skipped: a request
        preempted before its prompt was done recomputes them)."""
        lps, ids, tops = self.logprobs.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        row = 0
        for seq, first, count in self.spans:
            n = seq.params.prompt_logprobs
            if first == 1 and not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            for i in range(count):
                if first + i == len(seq.prompt_logprobs):
                    entry = dict(zip(ids[row + i][:n], tops[row + i][:n]))
                    entry[seq.token_ids[first + i]] = lps[row + i]
                    seq.prompt_logprobs.append(entry)
            row += count


def launch_prompt_logprobs(
    chunks: list[Chunk],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    uploads: Uploads | None = None,
) -> PromptLogprobs | None:
    """The prompt logprobs that this step's chunks give, queued on the device (hidden: [T, H] of every
    computed token, packed in chunk order). None when no chunk's request asks for them."""
    spans, rows, targets, offset = [], [], [], 0
    for chunk in chunks:
        seq, start = chunk.seq, chunk.start
        if seq.wants_prompt_logprobs:
            stop = min(start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)  # the last predicts the output
            if stop > start:
                spans.append((seq, start + 1, stop - start))
                rows += range(offset, offset + stop - start)
                targets += seq.token_ids[start + 1 : stop + 1]
            elif start == 0:  # a one-token prompt: only the None of its first token
                spans.append((seq, 1, 0))
        offset += chunk.num_new_tokens
    if not spans:
        return None
    device = hidden.device
    rows_t, targets_t = to_device(rows, torch.int64, device, uploads), to_device(targets, torch.int64, device, uploads)
    top = max(seq.params.prompt_logprobs for seq, _, _ in spans)
    parts = []
    for i in range(0, len(rows), _ROWS_PER_PASS):
        logprobs = compute_logits(hidden[rows_t[i : i + _ROWS_PER_PASS]]).float().log_softmax(-1)  # [r, V]
        own = logprobs.gather(-1, targets_t[i : i + _ROWS_PER_PASS, None])[:, 0]
        top_lps, top_ids = logprobs.topk(top, -1)
        parts.append((own, top_ids, top_lps))
    if not parts:  # only one-token prompts (with top 0, an empty [0, 0] has no column to take)
        empty = torch.empty(0, top, device=device)
        return PromptLogprobs(spans, torch.empty(0, device=device), empty.long(), empty)
    own, top_ids, top_lps = (torch.cat(p) for p in zip(*parts))
    return PromptLogprobs(spans, own, top_ids, top_lps)
