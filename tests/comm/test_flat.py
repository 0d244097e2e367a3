"""Flat buffers with a named tally: the layout, and the sums at several ranks against arithmetic."""

import pytest
import torch

from mpisolve.comm.communicator import Communicator
from mpisolve.comm.flat import FusedBuffer, HostTally, TalliedBuffer, Tally
from mpisolve.errors import UnsupportedModelError


def test_fused_buffer_views_alias_the_flat_buffer():
    buf = FusedBuffer([torch.Size([2, 3]), torch.Size([]), torch.Size([0]), torch.Size([5])], torch.float32, extra=1)
    assert buf.numel == 6 + 1 + 0 + 5
    assert buf.flat.numel() == buf.numel + 1
    buf.views[0].fill_(1.0)
    buf.views[1].fill_(2.0)
    buf.views[3].fill_(3.0)
    buf.extra.fill_(9.0)
    assert buf.flat.tolist() == [1.0] * 6 + [2.0] + [3.0] * 5 + [9.0]
    assert [v.shape for v in buf.views] == [torch.Size([2, 3]), torch.Size([]), torch.Size([0]), torch.Size([5])]


def test_pack_copies_and_casts_into_place():
    buf = FusedBuffer([torch.Size([3]), torch.Size([2, 2])], torch.float32)
    buf.pack([torch.tensor([1, 2, 3], dtype=torch.float16), torch.arange(4.0, dtype=torch.float64).view(2, 2)])
    assert buf.flat.tolist() == [1, 2, 3, 0, 1, 2, 3]


def test_a_tally_names_its_elements_in_order():
    tally = Tally(samples=1, speeds=3, active=1)
    assert tally.size == 5
    assert tally.at == {"samples": 0, "speeds": 1, "active": 4}
    assert tally.span["speeds"] == slice(1, 4)


def test_flattened_parameters_are_views_and_mixed_dtypes_are_refused():
    params = [torch.nn.Parameter(torch.arange(4.0).view(2, 2)), torch.nn.Parameter(torch.ones(3))]
    buffer = TalliedBuffer.of_parameters(Communicator(), params, Tally(samples=1), who="test").buffer
    assert buffer.flat.tolist() == [0, 1, 2, 3, 1, 1, 1, 0]
    params[1].data.fill_(5.0)
    assert buffer.flat[4:7].tolist() == [5, 5, 5]
    with pytest.raises(UnsupportedModelError, match="test needs parameters of one dtype"):
        TalliedBuffer.of_parameters(
            Communicator(), [params[0], torch.nn.Parameter(torch.ones(1, dtype=torch.float64))], Tally(), who="test"
        )


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_a_tallied_buffer_sums_its_tensors_and_its_counts_in_one_round():
    comm = Communicator()
    n, me = comm.size, comm.rank
    wire = TalliedBuffer.laid_out(
        comm, [torch.Size([2, 3]), torch.Size([4])], torch.float32, torch.device("cpu"), Tally(samples=1, active=1)
    )
    assert wire.buffer.flat.numel() == 10 + 2  # on the CPU the tally rides at the end: one message
    for view in wire.buffer.views:
        view.fill_(me + 1.0)
    wire.counts.set("samples", 10 * (me + 1))
    wire.counts.set("active", int(me != 0))
    for _ in range(2):  # reused: every round sums afresh what was written into it
        wire.start()
        wire.wait("test tally")
        assert wire.counts.count("samples") == 10 * n * (n + 1) // 2
        assert wire.counts.count("active") == n - 1
        torch.testing.assert_close(wire.body, torch.full((10,), n * (n + 1) / 2))
        wire.body.fill_(me + 1.0)
        wire.counts.set("samples", 10 * (me + 1))
        wire.counts.set("active", int(me != 0))
    wire.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_host_tally_without_a_wire_sums_beside_it():
    comm = Communicator()
    counts = HostTally(comm, Tally(samples=1, ranks=1))
    counts.set("samples", comm.rank)
    counts.set("ranks", 1)
    counts.start()
    counts.wait("test tally")
    assert (counts.count("samples"), counts.count("ranks")) == (comm.size * (comm.size - 1) // 2, comm.size)
    counts.free()
