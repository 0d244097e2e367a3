"""Models as real scripts have them, for every solver: frozen parameters and a branch not
taken (its parameters get no gradient on some ranks at some steps: zeros, no hang), a layer
used twice in one forward (tied), a ``torch.compile``'d model, float32 and bfloat16
parameters side by side, and BatchNorm running statistics (rank 0's on every rank by
default, as DDP's ``broadcast_buffers``). Each ends as its oracle says, or refused with a
clear error on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpisolve.errors import UnsupportedModelError

from .harness import (
    HIDDEN,
    IN,
    LR,
    OUT,
    all_raised,
    all_ranks_equal,
    assert_close,
    cases,
    documented_step,
    expected,
    final_params,
    global_batch,
    loss_fn,
    run,
    shard,
)

STEPS = 3
#: The solvers with ``broadcast_buffers`` (their ranks hold one model).
SYNCHRONOUS = ("allreduce", "adasum", "adasum-gradient", "lb-bsp", "kfac")


class FrozenAndBranch(nn.Module):
    """A frozen embedding-like layer, a trunk, and two heads of which each forward uses one:
    the head depends on rank and step, so at every step some rank leaves each head unused."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(IN, IN)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Linear(IN, HIDDEN)
        self.heads = nn.ModuleList([nn.Linear(HIDDEN, OUT), nn.Linear(HIDDEN, OUT)])
        self.use = 0

    def prepare(self, rank: int, step: int) -> None:
        self.use = (rank + step) % 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[self.use](torch.tanh(self.trunk(self.frozen(x))))


def frozen_and_branch() -> nn.Module:
    torch.manual_seed(0)
    return FrozenAndBranch()


class Tied(nn.Module):
    """One layer applied twice in the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(IN, IN)
        self.head = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def tied() -> nn.Module:
    torch.manual_seed(0)
    return Tied()


class Mixed(nn.Module):
    """A bfloat16 layer feeding a float32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Linear(IN, HIDDEN).to(torch.bfloat16)
        self.high = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(torch.tanh(self.low(x.to(torch.bfloat16))).float())


def mixed() -> nn.Module:
    torch.manual_seed(0)
    return Mixed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_frozen_parameters_and_a_branch_not_taken(comm, case):
    got = run(case, comm, STEPS, build=frozen_and_branch)
    assert_close(got, expected(case, comm, STEPS, build=frozen_and_branch), f"{case.id}, frozen and branch")
    assert torch.equal(
        got[: IN * IN + IN], torch.cat([p.double().reshape(-1) for p in frozen_and_branch().frozen.parameters()])
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_tied_weights(comm, case):
    if case.id != "kfac":
        got = run(case, comm, STEPS, build=tied)
        assert_close(got, expected(case, comm, STEPS, build=tied), f"{case.id}, tied")
        return
    model = tied()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    error = None
    try:
        documented_step(solver, model, None, 0)
    except RuntimeError as err:
        error = err
    final_params(solver, model)
    assert all(m is not None and "weight sharing" in m for m in all_raised(comm, error))


def compiled() -> nn.Module:
    """The compiled module is what the solver is given (its hooks run eagerly around the graph).

    Compiled afresh, as in a new script: torch.compile reuses a graph traced for another
    instance of the class without looking at hooks added since.
    """
    torch._dynamo.reset()
    return torch.compile(frozen_and_branch(), backend="aot_eager")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)  # compiling costs seconds: one world size, one solver per kind of hook
@pytest.mark.parametrize("case", cases(("allreduce", "kfac", "local-sgd")), ids=lambda c: c.id)
def test_torch_compile(comm, case):
    """Buckets (gradient hooks, the sample-counting forward pre-hook), K-FAC's layer hooks, and
    parameters made views of one flat vector (the local-step solvers), under AOTAutograd."""
    got = run(case, comm, STEPS, build=compiled)
    assert_close(got, expected(case, comm, STEPS, build=frozen_and_branch), f"{case.id}, compiled")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("case", cases(("allreduce", "kfac")), ids=lambda c: c.id)
def test_compiled_before_the_solver_is_refused_not_miscounted(comm, case):
    """The solver is made after the compiled module's first call: torch.compile does not see hooks
    added after it, so the solver sees no forward (K-FAC: no layer): a clear error, not a
    silently wrong sample count or preconditioner."""
    from .harness import make_model

    torch._dynamo.reset()
    model = make_model()
    fast = torch.compile(model, backend="eager")
    x, y = shard(global_batch(0, comm.size), comm.rank)
    fast(x)  # compiled for this shape before the solver's hooks existed
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    error = None
    loss_fn(fast(x), y).backward()
    try:
        solver.step()
    except RuntimeError as err:
        error = err
    solver.close()
    want = "make the solver first" if case.id == "kfac" else "give the compiled module to make_solver"
    assert all(m is not None and want in m for m in all_raised(comm, error))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_float32_and_bfloat16_parameters(comm, case):
    model = mixed()
    try:
        solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    except UnsupportedModelError as err:  # one flat vector of one dtype: refused at construction
        assert all(m is not None and "one dtype" in m for m in all_raised(comm, err))
        return
    solver.close()
    got = run(case, comm, STEPS, build=mixed)
    want = expected(case, comm, STEPS, build=mixed)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3, msg=lambda m: f"{case.id}, mixed dtypes: {m}")


def batch_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize(
    "case", cases(("allreduce", "adasum", "adasum-gradient", "lb-bsp", "kfac")), ids=lambda c: c.id
)
def test_batch_norm_buffers_are_rank_zeros_by_default(comm, case):
    """broadcast_buffers=True: every rank ends with rank 0's running statistics, which are what
    rank 0 computes on its own (the run with broadcast_buffers=False shows them); evaluation
    agrees across ranks. False: each rank keeps its own."""

    def train(broadcast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model = batch_norm()
        solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm, broadcast_buffers=broadcast)
        for k in range(STEPS):
            documented_step(solver, model, None, k)
        with solver.evaluating() as m, torch.no_grad():
            out = m.eval()(global_batch(0, 1)[0]).double().reshape(-1)
        m.train()
        solver.close()
        return torch.cat([b.double().reshape(-1) for b in model.buffers()]), out

    shared, shared_out = train(True)
    own, _ = train(False)
    assert all_ranks_equal(comm, shared) and all_ranks_equal(comm, shared_out)
    rank0_own = torch.tensor(comm.bcast_object(own.tolist()), dtype=torch.float64)
    torch.testing.assert_close(shared, rank0_own, rtol=1e-5, atol=1e-6)
    assert not all_ranks_equal(comm, own)
