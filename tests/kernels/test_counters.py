"""The shared-memory counters' kernels, and the round kernels built on them, on strided counters as in a window."""

import gc

import numpy as np
import pytest
import torch

from mpisolve.kernels import counters
from mpisolve.kernels.slots import SlotRound, arrival, host_rows, publication, published_copy, round_sum

STRIDE = 8  # one int64 counter per 64-byte cache line


def strided(values: list[int]) -> np.ndarray:
    memory = np.zeros(len(values) * STRIDE, dtype=np.int64)
    view = memory[::STRIDE]
    view[:] = values
    return view


def test_publish_sets_one_counter_and_reached_reads_every_one():
    c = strided([0, 0, 0])
    counters.publish(c, 1, 7)
    assert c.base[STRIDE] == 7 and c.tolist() == [0, 7, 0]  # the counter's own cache line, nothing else
    assert counters.reached(c, 0) and not counters.reached(c, 1)
    assert counters.reached_one(c, 1, 7) and not counters.reached_one(c, 1, 8)
    for i in (0, 2):
        counters.publish(c, i, 9)
    assert counters.reached(c, 7) and not counters.reached(c, 8)


@pytest.mark.parametrize("yielding", [False, True])
def test_a_bounded_spin_gives_up_after_its_polls(yielding):
    c = strided([3, 2])
    assert counters.reached_within(c, 2, 0, yielding) and counters.reached_within(c, 2, 5, yielding)
    assert not counters.reached_within(c, 3, 1000, yielding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_round_sums_only_once_every_rank_has_arrived(dtype):
    ranks, numel = 3, 100
    rows = (torch.arange(ranks * numel, dtype=torch.float32).view(ranks, numel) / 7).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((numel,), -1.0, dtype=acc)
    tally_rows = np.arange(ranks * 2, dtype=np.float64).reshape(ranks, 2)
    tally_out = np.zeros(2)
    c = strided([4, 4, 3])
    run = round_sum(
        SlotRound(c, host_rows(rows), 10, 90, out.numpy(), tally_rows, tally_out, 0.5, brain=dtype == torch.bfloat16)
    )
    assert not run(4, 3)  # rank 2 is a round behind: nothing summed
    assert (out == -1).all() and (tally_out == 0).all()
    counters.publish(c, 2, 4)
    assert run(4, 0)
    want = (rows.to(acc)[0] + rows.to(acc)[1] + rows.to(acc)[2]) * 0.5
    assert torch.equal(out[10:90], want[10:90]) and (out[:10] == -1).all() and (out[90:] == -1).all()
    assert tally_out.tolist() == tally_rows.sum(axis=0).tolist()  # unscaled


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_arrival_copies_in_publishes_and_sums_only_if_it_came_last(dtype):
    rows, tally_rows = np.zeros((2, 5), dtype), np.zeros((2, 2))
    out, tally_out = np.full(5, -1.0, dtype), np.zeros(2)
    c = strided([0, 0])
    sums = SlotRound(c, rows, 0, 5, out, tally_rows, tally_out)
    source, tally = np.arange(5, dtype=dtype) / 3, np.array([3.0, 1.0])
    assert not arrival(source, rows[1], tally, tally_rows[1], 1, sums)(6)  # rank 0 has not arrived
    assert rows[1].tolist() == source.tolist() and tally_rows[1].tolist() == [3.0, 1.0] and c.tolist() == [0, 6]
    assert (out == -1).all() and (tally_out == 0).all()
    assert arrival(source * 10, rows[0], tally, tally_rows[0], 0, sums)(6)  # the last to arrive sums
    assert c.tolist() == [6, 6] and out.tolist() == (source * 10 + source).tolist() and tally_out.tolist() == [6.0, 2.0]


def test_an_arrival_that_does_not_sum_copies_in_and_publishes_only():
    rows, tally_rows = np.zeros((2, 3), np.float32), np.zeros((2, 1))
    out, tally_out = np.full(3, -1.0, np.float32), np.zeros(1)
    c = strided([5, 0])  # rank 0 has arrived: an arrival that sums would sum now
    sums = SlotRound(c, rows, 0, 3, out, tally_rows, tally_out)
    source = np.array([1.0, 2.0, 3.0], np.float32)
    assert not arrival(source, rows[1], np.ones(1), tally_rows[1], 1, sums, sum_at_arrival=False)(5)
    assert rows[1].tolist() == [1.0, 2.0, 3.0] and tally_rows[1].tolist() == [1.0] and c.tolist() == [5, 5]
    assert (out == -1).all() and (tally_out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("yielding", [False, True])
def test_a_published_result_is_copied_only_once_its_counter_reaches_the_round(dtype, yielding):
    values = torch.tensor([1.5, -0.0, float("inf"), float("nan"), 3e-5], dtype=dtype)
    shared, mine = torch.zeros(5, dtype=dtype), torch.full((5,), 7.0, dtype=dtype)
    shared_tally, my_tally = np.zeros(2), np.zeros(2)
    c = strided([0, 0])  # the publisher's counter first, as a leader's
    publish = publication(host_rows(values), host_rows(shared), np.array([4.0, 2.0**40]), shared_tally, c, 0)
    take = published_copy(c[:1], host_rows(shared), host_rows(mine), shared_tally, my_tally, yielding=yielding)
    assert not take(1, 3)  # nothing published: nothing copied
    assert (mine == 7).all() and (my_tally == 0).all()
    publish(1)
    assert c.tolist() == [1, 0] and shared.view(torch.uint8).tolist() == values.view(torch.uint8).tolist()
    assert take(1, 0) and not take(2, 2)
    assert mine.view(torch.uint8).tolist() == values.view(torch.uint8).tolist()  # every bit, NaN's and -0's too
    assert my_tally.tolist() == [4.0, 2.0**40]


def test_an_arrival_of_half_precision_copies_its_bits():
    values = torch.tensor([1.0, -0.0, 65504.0, float("inf"), float("nan"), 6e-8], dtype=torch.float16)
    slots = torch.zeros(2, 6, dtype=torch.float16)
    rows, out = host_rows(slots), np.zeros(6, np.float32)
    sums = SlotRound(strided([0, 0]), rows, 0, 6, out, np.zeros((2, 0)), np.zeros(0))
    assert not arrival(host_rows(values.view(1, -1))[0], rows[1], np.zeros(0), np.zeros((2, 0))[1], 1, sums)(1)
    assert torch.equal(slots[1].view(torch.int16), values.view(torch.int16))  # every bit, NaN's and -0's too


def test_a_round_holds_the_arrays_it_points_into():
    # Its compiled call is given their addresses, not the arrays: were they freed, it would
    # read and write freed memory. Made of temporaries, dropped, their memory then reused.
    out = np.zeros(4096, np.float32)
    run = round_sum(
        SlotRound(strided([1, 1]), np.ones((2, 4096), np.float32), 0, 4096, out, np.ones((2, 1)), np.zeros(1))
    )
    gc.collect()
    litter = [np.full((2, 4096), 7.0, np.float32) for _ in range(64)]
    assert run(1, 0) and (out == 2.0).all()
    del litter


def test_arrays_a_round_cannot_take_by_address_are_refused():
    c = strided([0, 0])
    rows, out, none = np.zeros((2, 10), np.float32), np.zeros(10, np.float32), np.zeros((2, 0))
    with pytest.raises(ValueError, match="rows must be C-contiguous"):
        SlotRound(c, rows[:, ::2], 0, 5, out, none, np.zeros(0))
    with pytest.raises(TypeError, match="rows are float32, float64 or half"):
        SlotRound(c, np.zeros((2, 10), np.int32), 0, 5, np.zeros(10, np.int32), none, np.zeros(0))
    with pytest.raises(TypeError, match="counters are a vector of int64"):
        SlotRound(c.astype(np.int32), rows, 0, 5, out, none, np.zeros(0))
    with pytest.raises(ValueError, match="increasing addresses"):
        SlotRound(c[::-1], rows, 0, 5, out, none, np.zeros(0))
    sums = SlotRound(c, rows, 0, 10, out, none, np.zeros(0))
    with pytest.raises(ValueError, match="index 2 names no counter"):
        arrival(out, rows[0], np.zeros(0), np.zeros(0), 2, sums)
    with pytest.raises(ValueError, match="source must be C-contiguous"):
        arrival(np.zeros(20, np.float32)[::2], rows[0], np.zeros(0), np.zeros(0), 0, sums)
    with pytest.raises(TypeError, match="tally is a vector of float64"):
        arrival(out, rows[0], np.zeros(1, np.float32), np.zeros(1, np.float32), 0, sums)


def test_a_publication_and_its_copy_refuse_what_they_cannot_take():
    c = strided([0, 0])
    with pytest.raises(ValueError, match="cannot copy"):
        publication(np.zeros(5, np.float32), np.zeros(4, np.float32), np.zeros(0), np.zeros(0), c, 0)
    with pytest.raises(ValueError, match="names no counter"):
        publication(np.zeros(5, np.float32), np.zeros(5, np.float32), np.zeros(0), np.zeros(0), c, 2)
    with pytest.raises(TypeError, match="one int64"):
        published_copy(c, np.zeros(5, np.float32), np.zeros(5, np.float32), np.zeros(0), np.zeros(0))
    with pytest.raises(TypeError, match="float64"):
        single = np.zeros(1, np.float32)
        published_copy(c[:1], np.zeros(5, np.float32), np.zeros(5, np.float32), single, single.copy())


def test_mismatched_arguments_are_named():
    c = strided([0, 0])
    sums = SlotRound(c, np.zeros((2, 5), np.float32), 0, 5, np.zeros(5, np.float32), np.zeros((2, 0)), np.zeros(0))
    with pytest.raises(ValueError, match="cannot copy float32"):
        arrival(np.zeros(5, np.float32), np.zeros(4, np.float32), np.zeros(0), np.zeros(0), 0, sums)
    with pytest.raises(ValueError, match="cannot copy a tally"):
        arrival(np.zeros(5, np.float32), np.zeros(5, np.float32), np.zeros(2), np.zeros(1), 0, sums)
    with pytest.raises(TypeError, match="tally is float64"):
        SlotRound(c, np.zeros((2, 5), np.float32), 0, 5, np.zeros(5, np.float32), np.zeros((2, 1)), np.zeros(2))
    with pytest.raises(ValueError, match="outside rows"):
        SlotRound(c, np.zeros((2, 5), np.float32), 0, 6, np.zeros(5, np.float32), np.zeros((2, 0)), np.zeros(0))


def test_compare_exchange_sets_only_the_expected_value_and_fetch_add_adds():
    c = strided([4, 4])
    assert counters.compare_exchange(c, 1, 3, 9) == 4 and c.tolist() == [4, 4]  # not 3: unchanged
    assert counters.compare_exchange(c, 1, 4, 9) == 4 and c.tolist() == [4, 9]
    assert counters.fetch_add(c, 0, -5) == 4 and c.tolist() == [-1, 9]
    assert c.base[1:STRIDE].tolist() == [0] * (STRIDE - 1)  # the word's own cache line, nothing else


def test_a_lock_word_admits_readers_together_and_a_writer_alone():
    c = strided([0, 0])
    assert counters.try_lock_shared(c, 0) and counters.try_lock_shared(c, 0) and c.tolist() == [2, 0]
    assert not counters.try_lock_exclusive(c, 0, False)  # readers hold it
    assert counters.try_lock_exclusive(c, 1, False) and c.tolist() == [2, counters.WRITER]  # the other word is free
    assert not counters.try_lock_shared(c, 1) and not counters.try_lock_exclusive(c, 1, False)
    counters.unlock_exclusive(c, 1)
    counters.unlock_shared(c, 0)
    counters.unlock_shared(c, 0)
    assert c.tolist() == [0, 0]


def test_a_waiting_writer_keeps_new_readers_out_and_is_uncounted_when_it_takes_the_lock():
    c = strided([0])
    assert counters.try_lock_shared(c, 0)
    counters.fetch_add(c, 0, counters.WAITING)  # a writer waits for the reader
    assert not counters.try_lock_shared(c, 0)  # a second reader may not overtake it
    assert not counters.try_lock_exclusive(c, 0, True)
    counters.unlock_shared(c, 0)
    assert counters.try_lock_exclusive(c, 0, True) and c.tolist() == [counters.WRITER]
    counters.unlock_exclusive(c, 0)
    assert c.tolist() == [0] and counters.try_lock_shared(c, 0)
