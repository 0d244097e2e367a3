"""Adasum's node path on real ranks: the numpy tree, bit for bit the message path, taken where
ranks share a node (partners read in place, no message between them), off where it must be.

Also run on the emulated 2-node cluster (``make test-cluster``, marker ``cluster``), where the
levels between the nodes stay on MPI.
"""

import re

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpisolve
from mpisolve.comm import collectives, shm
from mpisolve.comm.adasum import Adasum, _Message, _Progress
from mpisolve.comm.communicator import Communicator
from tests.adasum_reference import tree

ALL_SIZES = pytest.mark.ranks(2, 3, 4, 5, 8)
# Sizes that put VHDD's cuts inside tensors, and one large enough for every rank to hold a piece.
SHAPES = [(3, 4), (7,), (257,), (1000, 3), (1,)]


def rank_tensors(rank: int, round_: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * round_ + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]


def node_ranks(comm: Communicator) -> set[int]:
    """World ranks on this rank's node, from MPI's shared-memory split (not the code under test)."""
    return set(comm.node.allgather(comm.rank))


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
def test_node_path_matches_the_reference_and_the_message_path_bit_for_bit():
    on, off = Communicator(), Communicator(node_shm=False)
    windows: list[MPI.Win] = []
    try:
        for round_ in range(3):  # the kept windows reused, with new inputs and new output buffers
            mine = rank_tensors(on.rank, round_, torch.float64) + rank_tensors(on.rank, round_, torch.float32)
            got = mpisolve.allreduce(mine, op="adasum", comm=on)
            by_messages = mpisolve.allreduce(mine, op="adasum", comm=off)
            for i, (g, m) in enumerate(zip(got, by_messages)):
                # Same kernels on the same operands in the same order, on one machine: equal bits.
                assert torch.equal(g, m), f"tensor {i}, round {round_}"
                everyone = [
                    (rank_tensors(r, round_, torch.float64) + rank_tensors(r, round_, torch.float32))[i]
                    for r in range(on.size)
                ]
                expected = tree([t.numpy() for t in everyone])
                tol = 1e-12 if g.dtype == torch.float64 else 1e-5
                np.testing.assert_allclose(g.double().numpy().ravel(), expected, rtol=tol, atol=tol)
        cache = collectives._KEPT[on].kept
        assert cache is not None
        kept = cache.by_key.values()  # the node path's windows, kept for the next call
        windows = [r.node.win for r in kept if r.node is not None]
        assert windows
    finally:
        on.free()
        off.free()
    assert all(w == MPI.WIN_NULL for w in windows)  # freed with the communicator


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
def test_partners_on_the_node_are_read_in_place_and_the_others_by_messages():
    comm = Communicator()
    adasum = Adasum(comm)
    reduction = adasum.reduction(torch.zeros(5000), [3000, 2000])
    try:
        assert reduction.node is not None  # several ranks on every node here
        local = node_ranks(comm) - {comm.rank}
        # Stages that step with one partner end with its rank: fold, exchange, gather.
        steps = [(s, re.search(r"rank (\d+)$", s.name)) for s in reduction.stages]
        paired = [(s, int(m.group(1))) for s, m in steps if m is not None]
        assert paired  # every rank steps with some partner
        for stage, partner in paired:
            kinds = {type(op) for op in stage.operations}
            if partner in local:
                assert kinds == {_Progress}, stage.name  # a counter in the window, no message
            else:
                assert kinds <= {_Message}, stage.name
        assert any(isinstance(op, _Progress) for s, _ in paired for op in s.operations) == any(
            p in local for _, p in paired
        )
    finally:
        reduction.free()
        comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3, 4)
def test_a_buffer_whose_window_passes_the_cap_on_kept_windows_takes_the_message_path(monkeypatch):
    """Past ``MPISOLVE_NODE_SHM_KEEP_BYTES`` a buffer's reduction makes no window and is not kept: the
    message path, the same bits; those within it are kept."""
    monkeypatch.setenv(shm.KEEP_BYTES_ENV, str(64 * 1024))
    on, off = Communicator(), Communicator(node_shm=False)
    try:
        group = shm.node_group(on)
        if group is None:
            pytest.skip("node-shared sums do not apply to this layout")
        assert group.keep_bytes == 64 * 1024
        for numel, windowed in ((500, True), (40_000, False), (1000, True)):
            mine = [torch.randn(numel, generator=torch.Generator().manual_seed(on.rank), dtype=torch.float64)]
            got = mpisolve.allreduce(mine, op="adasum", comm=on)
            assert torch.equal(got[0], mpisolve.allreduce(mine, op="adasum", comm=off)[0])
            kept = collectives._KEPT[on]
            assert kept.kept is not None
            assert any(key[1] == numel for key in kept.kept.by_key) == windowed
            assert kept.kept.nbytes == sum(r.nbytes for r in kept.kept.by_key.values()) <= group.keep_bytes
        assert [key[1] for key in kept.kept.by_key] == [500, 1000]
    finally:
        on.free()
        off.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
def test_fused_buffers_whose_windows_pass_the_cap_together_keep_the_first_and_send_the_rest():
    """Two fused buffers (float32, float64) whose windows fit the cap on kept windows alone, not together:
    the first is kept on the node path, the second takes the message path (none frees the other's window
    while the call needs it); both the message path's bits, twice over."""
    on, off = Communicator(), Communicator(node_shm=False)
    try:
        mpisolve.allreduce([torch.ones(4)], op="adasum", comm=on)  # the communicator's Adasum, made
        kept = collectives._KEPT[on]
        if kept.kept is None:
            pytest.skip("node-shared sums do not apply to this layout")
        windows = [kept.adasum.window_bytes(torch.empty(1000, dtype=d)) for d in (torch.float32, torch.float64)]
        assert None not in windows
        kept.kept.free()
        kept.kept.keep_bytes = max(windows) + 1
        for round_ in range(2):
            g = torch.Generator().manual_seed(100 * round_ + on.rank)
            mine = [torch.randn(1000, generator=g).float(), torch.randn(1000, generator=g, dtype=torch.float64)]
            got = mpisolve.allreduce(mine, op="adasum", comm=on)
            want = mpisolve.allreduce(mine, op="adasum", comm=off)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert [(key[0], key[2]) for key in kept.kept.by_key] == [(0, torch.float32)]
    finally:
        on.free()
        off.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("kind", ["node_shm off", "staged"])
def test_falls_back_to_the_message_path(kind):
    comm = Communicator(node_shm=False) if kind == "node_shm off" else Communicator(stage_all=True)
    adasum = Adasum(comm)
    flat = torch.arange(10, dtype=torch.float64) * (comm.rank + 1)
    reduction = adasum.reduction(flat, [6, 4])
    try:
        assert reduction.node is None
        assert not any(isinstance(op, _Progress) for s in reduction.stages for op in s.operations)
        adasum.start(reduction)
        adasum.finish(reduction)
        everyone = [np.arange(10.0) * (r + 1) for r in range(comm.size)]
        expected = np.concatenate([tree([e[:6] for e in everyone]), tree([e[6:] for e in everyone])])
        np.testing.assert_allclose(flat.numpy(), expected, rtol=1e-12)
    finally:
        reduction.free()
        comm.free()


def _train(comm: Communicator, mode: str) -> tuple[list[torch.Tensor], list[bool], list[bool]]:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    solver = mpisolve.make_solver(
        "adasum", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, mode=mode
    )
    reducer = solver.grads.reducer if mode == "gradient" else solver.deltas.reducer
    on_node = [r.node is not None for r in reducer.reductions.values()]
    in_place = [r.node is not None and r.in_place for r in reducer.reductions.values()]
    windows = [r.node.win for r in reducer.reductions.values() if r.node is not None]
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        solver.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        solver.step()
    params = [p.detach().clone() for p in model.parameters()]
    solver.close()
    assert all(w == MPI.WIN_NULL for w in windows)  # the solver's close freed its windows
    return params, on_node, in_place


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
@pytest.mark.parametrize("mode", ["gradient", "delta"])
def test_the_solver_takes_the_node_path_in_both_modes_and_steps_as_without_it(mode):
    on, off = Communicator(), Communicator(node_shm=False)
    try:
        params_on, node_on, in_place = _train(on, mode)
        params_off, node_off, _ = _train(off, mode)
        assert node_on and all(node_on) and not any(node_off)
        # Delta mode keeps its buckets in the window (no copy in or out); gradient mode's
        # buckets are GradientBuckets' own memory, copied in and out.
        assert all(in_place) if mode == "delta" else not any(in_place)
        # Both runs compute the same forward and backward on this rank and machine; Adasum
        # is bit for bit the same on both paths, so every parameter is.
        for a, b in zip(params_on, params_off):
            assert torch.equal(a, b)
    finally:
        on.free()
        off.free()
