"""A step's uploads (engine/runner/step_inputs.py): host lists reach the device exactly, whatever their size,
dtype or thread, the reused host memory never changes a tensor already uploaded, and each runner owns its
memory (no arena shared by the engines of a thread or a process)."""

from __future__ import annotations

import threading

import pytest
import torch

from nanostream.engine.runner.step_inputs import Uploads, to_device, to_device_packed

CPU = torch.device("cpu")


@pytest.mark.parametrize("through", ["uploads", "plain"])
def test_each_dtype_arrives_exactly_and_packed_views_start_aligned(through):
    uploads = Uploads(CPU) if through == "uploads" else None
    if uploads is not None:
        uploads.new_step()
    ints = [0, 1, -1, 2**63 - 1, -(2**63)]
    assert to_device(ints, torch.int64, CPU, uploads).tolist() == ints
    assert to_device([7, -(2**31)], torch.int32, CPU, uploads).tolist() == [7, -(2**31)]
    floats = [0.5, 1e-5, 3.4e38, -2.0]
    want = torch.tensor(floats, dtype=torch.float32).tolist()
    assert to_device(floats, torch.float32, CPU, uploads).tolist() == want
    assert to_device([], torch.int64, CPU, uploads).tolist() == []
    a, b, c = to_device_packed(CPU, torch.int64, [1, 2, 3], list(range(17)), [9], uploads=uploads)
    assert (a.tolist(), b.tolist(), c.tolist()) == ([1, 2, 3], list(range(17)), [9])
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c))
    with pytest.raises((OverflowError, ValueError)):  # a value past the dtype is an error, never wrapped
        to_device([2**63], torch.int64, CPU, uploads)


def test_nested_lists_and_other_dtypes_take_the_plain_way():
    uploads = Uploads(CPU)
    uploads.new_step()
    assert to_device([[1, 2], [3, 4]], torch.int64, CPU, uploads).tolist() == [[1, 2], [3, 4]]
    assert to_device([1, 0, 1], torch.bool, CPU, uploads).tolist() == [True, False, True]
    assert uploads.offset == 0  # nothing of theirs went through the memory


def test_a_step_larger_than_the_memory_arrives_and_the_memory_grows_for_it():
    uploads = Uploads(CPU)
    big = list(range(uploads.halves[0].numel() // 8 + 1000))  # more int64 than a half holds
    for _ in range(3):  # each half: the plain way the first time, then from the grown memory
        uploads.new_step()
        assert to_device(big, torch.int64, CPU, uploads).tolist() == big
    assert min(h.numel() for h in uploads.halves) >= len(big) * 8
    uploads.new_step()
    assert uploads.upload(big, torch.int64) is not None


def test_tensors_uploaded_earlier_keep_their_values_when_the_memory_is_reused():
    uploads, kept = Uploads(CPU), []
    for step in range(6):  # both halves reused several times
        uploads.new_step()
        values = [step * 1000 + i for i in range(300)]
        kept.append((values, to_device(values, torch.int64, CPU, uploads)))
    assert all(t.tolist() == values for values, t in kept)


def test_two_runners_on_one_thread_keep_their_own_memory():
    # Two engines stepping in turn on one thread: a step of one never reuses the other's half.
    first, second = Uploads(CPU), Uploads(CPU)
    kept = []
    for step in range(6):
        for n, uploads in enumerate((first, second)):
            uploads.new_step()
            values = [n * 10**6 + step * 1000 + i for i in range(300)]
            kept.append((values, to_device(values, torch.int64, CPU, uploads)))
    assert all(t.tolist() == values for values, t in kept)
    assert {h.data_ptr() for h in first.halves}.isdisjoint(h.data_ptr() for h in second.halves)


def test_runners_on_threads_upload_side_by_side_without_mixing_their_values():
    failures = []

    def work(seed: int) -> None:
        uploads = Uploads(CPU)  # each thread's engine has its runner, and the runner its memory
        for step in range(200):
            uploads.new_step()
            values = [seed * 10**6 + step * 100 + i for i in range(50)]
            if to_device(values, torch.int64, CPU, uploads).tolist() != values:
                failures.append((seed, step))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
