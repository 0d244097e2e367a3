"""Every solver refuses mismatched models when built: the same one-line error on every rank, no hang."""

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.errors import ModelMismatchError


def models(rank, odd):
    """Rank ``odd`` differs in a later parameter's shape, in an extra parameter, or in a dtype."""
    shape = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3 if rank == odd else 2))
    count = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), *([nn.Linear(2, 2)] if rank == odd else []))
    dtype = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    if rank == odd:
        dtype = dtype.double()
    return [
        (
            shape,
            r"parameter 2 \('1.weight'\): rank 0 has '1.weight' shape \[2, 4\] float32, "
            r"rank\(s\) {odd} have '1.weight' shape \[3, 4\]",
        ),
        (count, r"parameter 4 \('2.weight'\): rank 0 has no such parameter, rank\(s\) {odd} have '2.weight'"),
        (
            dtype,
            r"parameter 0 \('0.weight'\): rank 0 has '0.weight' shape \[4, 3\] float32, "
            r"rank\(s\) {odd} have .* float64",
        ),
    ]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(3)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_every_solver_refuses_mismatched_models_on_every_rank(name):
    comm = mpisolve.init()
    odd = comm.size - 1
    for model, message in models(comm.rank, odd):
        with pytest.raises(ModelMismatchError, match=message.format(odd=odd)):
            mpisolve.make_solver(name, model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    comm.barrier()  # every rank got here: nobody is left waiting in a collective
