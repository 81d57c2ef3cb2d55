"""What a request must satisfy to be admitted, checked before anything is queued, and the model's EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

from nanostream.engine.block_manager import BlockManager
from nanostream.errors import InvalidRequestError
from nanostream.sampling_params import SamplingParams
from nanostream.token_ids import check_token_ids


def read_eos_token_ids(model_path: Path, hf_config) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json (either may hold one id or a list)."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = model_path / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def check_request(
    prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, block_manager: BlockManager
) -> int:
    """The request's max_tokens (None resolved against max_model_len), or ``InvalidRequestError`` saying
    what to change: it could never run as given."""
    if params.n != 1:
        raise InvalidRequestError(
            f"n must be 1 in an engine request, got {params.n}: LLM and AsyncClient send one request per sample"
        )
    n = len(prompt)
    if n == 0:
        raise InvalidRequestError("the prompt is empty; give at least one token")
    check_token_ids(prompt, vocab_size)
    limit = max_model_len
    if n >= limit:
        raise InvalidRequestError(
            f"the prompt has {n} tokens but max_model_len is {limit}, leaving no room to generate; "
            "shorten the prompt or raise max_model_len"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len "
            f"({limit}); lower max_tokens to at most {limit - n} or shorten the prompt"
        )
    blocks = block_manager.most_blocks_held(n + max_tokens)
    if blocks > block_manager.num_blocks:
        fits = block_manager.num_blocks * block_manager.block_size
        raise InvalidRequestError(
            f"prompt + max_tokens = {n + max_tokens} tokens needs {blocks} KV blocks but the cache has only "
            f"{block_manager.num_blocks} ({fits} tokens); lower max_tokens or give the engine more KV memory"
        )
    bad_stop = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError(f"stop token id {bad_stop} is outside the vocabulary [0, {vocab_size})")
    bad_bias = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad_bias is not None:
        raise InvalidRequestError(f"logit_bias names token id {bad_bias}, outside the vocabulary [0, {vocab_size})")
    return max_tokens
