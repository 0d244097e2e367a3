"""The checkpoint recipe of docs/guide/your-loop.md runs as printed: a run saved at step 3 and
resumed from there ends with the parameters of a run that never stopped (the optimizer's
momentum, the scheduler's learning rate and the solver's state all carried over)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.doc_blocks import python_block

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "your-loop.md"
STEPS, SAVE_AT = 6, 3


def recipe() -> str:
    """The Python block after the ``your-loop-checkpoint`` marker."""
    return python_block(GUIDE, "your-loop-checkpoint")


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def next_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_run_resumed_from_the_recipes_checkpoint_ends_where_an_uninterrupted_one_does(tmp_path):
    import mpisolve

    comm = mpisolve.init()
    directory = Path(comm.bcast_object(str(tmp_path) if comm.rank == 0 else None))  # one place for every rank
    namespace = {"build_model": build_model, "next_batch": next_batch}
    exec(compile(recipe(), str(GUIDE), "exec"), namespace)
    train = namespace["train"]
    uninterrupted = train(STEPS, str(directory / "a"))
    saved = train(STEPS, str(directory / "b"), save_at=SAVE_AT)
    resumed = train(STEPS, str(directory / "b"), resume=True)
    for u, s, r in zip(uninterrupted.parameters(), saved.parameters(), resumed.parameters()):
        torch.testing.assert_close(s, u, rtol=1e-6, atol=1e-7)  # saving changes nothing
        torch.testing.assert_close(r, u, rtol=1e-6, atol=1e-7)
    assert not torch.equal(resumed[0].weight, build_model()[0].weight)  # it trained
