"""The token-count buckets of the prefill CUDA graphs (engine/runner/prefill_graphs.py): every step size up
to the largest graph has a bucket, and padding to it wastes at most half of the bucket (a third above
1,024 tokens)."""

import bisect

import pytest

from nanostream.engine.runner.prefill_graphs import token_buckets


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 256, 4096, 5000, 8192])
def test_every_step_size_pads_to_a_bucket_at_most_twice_its_size(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    assert all(b % 16 == 0 for b in buckets[:-1])
    for n in range(1, max_tokens + 1):
        bucket = buckets[bisect.bisect_left(buckets, n)]
        assert n <= bucket <= max(16, 2 * n if bucket <= 1024 else 1.5 * n), (n, bucket)
