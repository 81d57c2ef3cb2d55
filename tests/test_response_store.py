"""The Responses API's store: bounded by count and by bytes, the least recently used leaving first."""

from __future__ import annotations

import json

import pytest

from nanostream.frontends.openai_server.response_store import ResponseStore


def response(i: int, size: int = 10) -> dict:
    return {"id": f"resp_{i}", "output": "x" * size}


def test_count_bound_evicts_the_least_recently_used():
    store = ResponseStore(max_responses=2)
    store.put(response(1), [])
    store.put(response(2), [])
    assert store.get("resp_1") is not None  # 1 is now the most recent
    store.put(response(3), [])
    assert (store.get("resp_2"), len(store)) == (None, 2)
    assert store.get("resp_1").response == response(1) and store.get("resp_3") is not None


def test_bytes_bound_counts_the_response_and_its_conversation():
    messages = [{"role": "user", "content": "y" * 100}]
    one = len(json.dumps(response(1, 100))) + len(json.dumps(messages))
    store = ResponseStore(max_bytes=2 * one)
    for i in range(3):
        assert store.put(response(i, 100), messages)
    assert [store.get(f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    assert store.bytes == 2 * one
    assert not store.put(response(9, 10 * one), [])  # alone over the bound: not kept, nothing evicted
    assert len(store) == 2


def test_delete_and_putting_an_id_again():
    store = ResponseStore()
    store.put(response(1), [])
    store.put(response(1, 50), [])
    assert len(store) == 1 and store.bytes == len(json.dumps(response(1, 50))) + 2
    assert store.delete("resp_1") and not store.delete("resp_1") and store.bytes == 0


def test_zero_keeps_nothing_and_negative_bounds_are_refused():
    assert not ResponseStore(max_responses=0).put(response(1), [])
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(max_bytes=-1)
