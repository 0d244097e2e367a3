"""The "kfac" solver on real ranks: the contract, variant equivalence, placement, state, fallbacks."""

import copy
import time

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.solvers.kfac import placement
from mpisolve.solvers.kfac.placement import EVERY_RANK
from mpisolve.solvers.kfac.solver import VARIANTS

EXACT = dict(factor_decay=0.0, kl_clip=None, factor_update_steps=1, inv_update_steps=1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.fc = nn.Linear(6 * 4 * 4, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.out(torch.tanh(self.fc(h.flatten(1))))


def batches(steps, ranks, per_rank=3):
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(per_rank * ranks, 2, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (per_rank * ranks,), generator=g),
        )
        for _ in range(steps)
    ]


def train(model, solver, data, shard):
    for x, y in data:
        solver.zero_grad()
        nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
        solver.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_every_rank(comm, tensor):
    gathered = comm.allgather_object(tensor.tolist())
    return all(g == gathered[0] for g in gathered)


#: Gradient-worker fractions: every rank preconditions every layer, groups of two, one rank per layer.
FRACTIONS = (1.0, 0.5, 0.0)


def workers_or_skip(comm, fraction):
    """Gradient workers per layer at this world size, or skip a fraction that does not divide it."""
    workers = max(1, round(comm.size * fraction))
    if comm.size % workers:
        pytest.skip(f"grad_worker_fraction {fraction} does not divide {comm.size} ranks")
    return workers


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_variants_equal_one_process_on_the_global_batch(method, fraction):
    comm = Communicator()
    workers_or_skip(comm, fraction)
    alone = comm.split(comm.rank)  # a one-rank communicator: the single-process reference
    shard = slice(comm.rank * 3, (comm.rank + 1) * 3)
    data = batches(4, comm.size)
    options = dict(
        method=method, factor_decay=0.9, kl_clip=0.01, factor_update_steps=1, inv_update_steps=2, fusion_profile_steps=1
    )
    torch.manual_seed(0)
    reference = Net().double()
    initial = copy.deepcopy(reference.state_dict())
    solver = mpisolve.make_solver(
        "kfac", reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), comm=alone, **options
    )
    train(reference, solver, data, slice(None))
    solver.close()
    for variant in VARIANTS:
        torch.manual_seed(comm.rank + 1)  # every rank different: construction must broadcast rank 0's
        model = Net().double()
        if comm.rank == 0:
            model.load_state_dict(initial)
        solver = mpisolve.make_solver(
            "kfac",
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            comm=comm.comm,
            variant=variant,
            grad_worker_fraction=fraction,
            **options,
        )
        train(model, solver, data, shard)
        if variant == "spd-kfac":
            assert "allreduce" in solver.comm_models  # the fusion plan was made and used
        torch.testing.assert_close(flat(model), flat(reference), rtol=1e-9, atol=1e-11, msg=variant)
        assert same_on_every_rank(comm, flat(model))
        solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_applied_direction_is_the_damped_kronecker_solve_of_the_global_factors():
    comm = Communicator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    reference = copy.deepcopy(model)  # rank 0's parameters everywhere: torch seeds alike
    damping = 0.02
    solver = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        comm=comm.comm,
        method="eigen",
        damping=damping,
        **EXACT,
    )
    g = torch.Generator().manual_seed(5)
    n = 2 * comm.size
    x, y = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    # Dense reference on the global batch: inputs, per-example output gradients, averaged gradients.
    inputs, outputs = {}, {}

    def keep(module, args, out):
        out.retain_grad()
        inputs[module], outputs[module] = args[0], out

    for i in (0, 2):
        reference[i].register_forward_hook(keep)
    nn.functional.cross_entropy(reference(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    shard = slice(2 * comm.rank, 2 * comm.rank + 2)
    solver.zero_grad()
    nn.functional.cross_entropy(model(x[shard]), y[shard]).backward()
    solver.step()
    for k, i in enumerate((0, 2)):
        abar = torch.cat([inputs[reference[i]], torch.ones(n, 1, dtype=torch.float64)], dim=1)
        a = abar.T @ abar / n
        per_example = outputs[reference[i]].grad * n
        gf = per_example.T @ per_example / n
        torch.testing.assert_close(solver.layers[k].a.matrix(), a)
        torch.testing.assert_close(solver.layers[k].g.matrix(), gf)
        v = torch.cat([reference[i].weight.grad, reference[i].bias.grad[:, None]], dim=1)
        dense = torch.kron(a, gf) + damping * torch.eye(a.shape[0] * gf.shape[0], dtype=torch.float64)
        expected = torch.linalg.solve(dense, v.T.reshape(-1)).view(v.shape[1], v.shape[0]).T
        applied = torch.cat(
            [before[2 * k] - model[i].weight.detach(), (before[2 * k + 1] - model[i].bias.detach())[:, None]], dim=1
        )
        torch.testing.assert_close(applied, expected, rtol=1e-9, atol=1e-12)
    solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_placement_is_shared_balanced_and_replicates_only_what_is_cheap(fraction):
    comm = Communicator()
    workers = workers_or_skip(comm, fraction)
    model = Net()
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm.comm, grad_worker_fraction=fraction
    )
    assert same_on_every_rank(comm, torch.tensor(solver.owners + solver.layer_group))
    groups = solver.groups
    assert all(len(g) == workers for g in groups) and sorted(r for g in groups for r in g) == list(range(comm.size))
    assert comm.rank in groups[solver.group]
    assert solver.own_layers == [i for i, g in enumerate(solver.layer_group) if comm.rank in groups[g]]
    workers_ranks = solver.inverting_ranks
    assert len(workers_ranks) == min(comm.size, comm.cores)  # one node here: one inverting rank per core
    for f, owner in enumerate(solver.owners):  # an owner preconditions the layer it inverts for
        assert owner == EVERY_RANK or (owner in groups[solver.layer_group[f // 2]] and owner in workers_ranks)
    dims = [f.dim for f in solver.factors]
    placed = [d for d, o in zip(dims, solver.owners) if o != EVERY_RANK]
    replicated = [d for d, o in zip(dims, solver.owners) if o == EVERY_RANK]
    if placed and replicated:
        assert max(replicated) <= min(placed)  # inverted everywhere only below the crossover size
    # Each rank's load, recounted here: what it owns, plus its group's replicated factors and preconditioning.
    expected = [0.0] * comm.size
    for f, (cost, owner) in enumerate(zip(solver.inversion_costs, solver.owners)):
        for r in [owner] if owner != EVERY_RANK else groups[solver.layer_group[f // 2]]:
            expected[r] += cost
    for i, cost in enumerate(solver.precondition_costs):
        for r in groups[solver.layer_group[i]]:
            expected[r] += cost
    assert solver.placement_loads() == pytest.approx(expected)
    # Balanced never does worse than the round-robin spread of the same work.
    naive_groups, naive_owners = placement.assign(
        solver.inversion_costs,
        solver.precondition_costs,
        groups,
        inverters=workers_ranks,
        replicated=[o == EVERY_RANK for o in solver.owners],
        balance=False,
    )
    naive = placement.loads(
        solver.inversion_costs,
        naive_owners,
        comm.size,
        precondition=solver.precondition_costs,
        layer_group=naive_groups,
        groups=groups,
    )
    assert max(solver.placement_loads()) <= max(naive) * (1 + 1e-9)
    mpd = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm=comm.comm,
        variant="mpd-kfac",
        grad_worker_fraction=fraction,
    )
    if workers == comm.size:
        assert mpd.owners == [f % comm.size for f in range(len(dims))]  # MPD-KFAC: round-robin
    else:
        assert mpd.layer_group == [i % len(groups) for i in range(len(solver.layers))]
    mpd.close()
    measured = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm=comm.comm,
        placement_cost="measured",
        replicate="never",
        grad_worker_fraction=fraction,
    )
    assert EVERY_RANK not in measured.owners and all(c > 0 for c in measured.inversion_costs)
    assert all(c > 0 for c in measured.precondition_costs)
    assert same_on_every_rank(comm, torch.tensor(measured.owners + measured.inversion_costs))
    measured.close()
    solver.close()


#: How far (a factor either way) a rank's measured inversion-plus-preconditioning seconds
#: per step (the median of a few steps) may be from the placement's prediction
#: (``placement_cost="measured"``, medians of a few timings). The prediction times each
#: size alone at construction, with every rank timing at once; a step runs them among the
#: step's other work (unpacking, KL clipping, writing the gradients), on a machine other
#: jobs share.
COST_MODEL_ERROR = 4.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_placement_cost_model_predicts_measured_seconds(fraction):
    comm = Communicator()
    workers_or_skip(comm, fraction)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(384, 384), nn.Tanh())])
    solver = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        comm=comm.comm,
        placement_cost="measured",
        replicate="never",
        factor_update_steps=1,
        inv_update_steps=1,
        grad_worker_fraction=fraction,
    )
    g = torch.Generator().manual_seed(comm.rank)
    measured = []
    for step in range(6):
        x = torch.randn(32, 384, generator=g)
        solver.reset_timings()
        solver.zero_grad()
        model(x).pow(2).mean().backward()
        solver.step()
        if step > 0:  # the first step pays for allocations
            measured.append(solver.timings["inversion"] + solver.timings["precondition"])
    predicted = solver.placement_loads()[comm.rank]
    median = sorted(measured)[len(measured) // 2]  # medians, as the prediction's timings
    everyone = comm.allgather_object((predicted, median))
    solver.close()  # before asserting, on every rank alike: a rank that failed alone would leave the others waiting
    ratios = {rank: m / p for rank, (p, m) in enumerate(everyone) if p > 0}
    assert all(1 / COST_MODEL_ERROR <= r <= COST_MODEL_ERROR for r in ratios.values()), (ratios, everyone)


@pytest.mark.mpi(min_size=3)
@pytest.mark.ranks(3)
def test_a_fraction_that_does_not_divide_the_ranks_is_refused_on_every_rank():
    comm = Communicator()
    model = nn.Linear(2, 2)
    with pytest.raises(mpisolve.OptionError, match=r"grad_worker_fraction 0\.5 at 3 ranks.*\[1, 3\]"):
        mpisolve.make_solver(
            "kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm.comm, grad_worker_fraction=0.5
        )


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_dict_round_trip_on_every_rank(fraction):
    comm = Communicator()
    workers_or_skip(comm, fraction)
    shard = slice(comm.rank * 3, (comm.rank + 1) * 3)
    data = batches(4, comm.size)
    options = dict(factor_update_steps=1, inv_update_steps=2, fusion_profile_steps=1, grad_worker_fraction=fraction)
    torch.manual_seed(0)
    model = Net().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    solver = mpisolve.make_solver("kfac", model, optimizer, comm=comm.comm, **options)
    train(model, solver, data[:2], shard)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), solver.state_dict()))
    assert same_on_every_rank(comm, saved[2]["factors"]["fc.A"]["running"])  # factors are global, decompositions not
    train(model, solver, data[2:], shard)
    solver.close()
    resumed = Net().double()
    resumed.load_state_dict(saved[0])
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed_opt.load_state_dict(saved[1])
    other = mpisolve.make_solver("kfac", resumed, resumed_opt, comm=comm.comm, **options)
    other.load_state_dict(saved[2])
    train(resumed, other, data[2:], shard)
    torch.testing.assert_close(flat(resumed), flat(model), rtol=1e-12, atol=1e-14)
    other.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_factor_that_cannot_be_inverted_falls_back_alike_everywhere(variant):
    comm = Communicator()
    torch.manual_seed(0)
    model = Net()
    solver = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        comm=comm.comm,
        variant=variant,
        method="inverse",
        factor_update_steps=1,
        inv_update_steps=1,
        factor_decay=0.5,
    )
    data = [(x.float(), y) for x, y in batches(2, comm.size)]
    shard = slice(comm.rank * 3, (comm.rank + 1) * 3)
    train(model, solver, data[:1], shard)
    kept = solver.layers[2].a.inverse.clone()
    solver.layers[2].a.running.view(-1)[0] = float("nan")  # a stored factor gone bad (on every rank: they are equal)
    if comm.rank == 0:
        with pytest.warns(RuntimeWarning, match=r"could not be decomposed.*fc\.A"):
            train(model, solver, data[1:], shard)
    else:
        train(model, solver, data[1:], shard)
    assert torch.equal(solver.layers[2].a.inverse, kept)
    assert torch.isfinite(flat(model)).all() and same_on_every_rank(comm, flat(model))
    solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("fuse", [False, True])
def test_inverter_places_inverts_and_shares_results(method, fuse):
    from mpisolve.solvers.kfac.inversion import Inverter
    from mpisolve.solvers.kfac.layers import Factor

    comm = Communicator()
    dims = [5, 9, 5, 3, 9, 1, 7]
    factors = []
    for i, n in enumerate(dims):
        factor = Factor(f"f{i}", n, method, torch.float64, torch.device("cpu"), packed=i % 2 == 0)
        x = torch.randn(n, n + 2, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        state = factor.state_dict()
        state.update(running=x @ x.T, updates=1)  # running averages stored full or as triangles
        factor.load_state_dict(state)
        factors.append(factor)
    owners = [i % comm.size if i % 3 else EVERY_RANK for i in range(len(dims))]
    shifts = [0.1 * (i + 1) for i in range(len(dims))]
    packed = [i % 2 == 1 for i in range(len(dims))]  # inverses broadcast as triangles or in full
    inverter = Inverter(
        comm.dup(),
        factors,
        range(len(dims)),
        owners,
        method=method,
        packed=packed,
        fuse_broadcasts=fuse,
        epoch=time.perf_counter(),
    )
    inverter.start(shifts)
    assert all(inverter.ready(f) for f, owner in enumerate(owners) if owner in (EVERY_RANK, comm.rank))
    inverter.wait(len(dims) - 1)
    assert inverter.ready(len(dims) - 1)
    inverter.finish()
    assert inverter.statuses.tolist() == [0] * len(dims)
    seconds = inverter.seconds
    assert seconds["inversion"] > 0 and seconds["inverse_wait"] >= 0 and seconds["inverse_transfer"] >= 0
    for f, factor in enumerate(factors):
        dense = factor.matrix()
        if method == "inverse":
            expected = torch.linalg.inv(dense + shifts[f] * torch.eye(dense.shape[0], dtype=torch.float64))
            torch.testing.assert_close(factor.inverse, expected)
            assert same_on_every_rank(comm, factor.inverse)
        else:
            torch.testing.assert_close(factor.vectors @ torch.diag(factor.values) @ factor.vectors.T, dense)
            assert same_on_every_rank(comm, factor.vectors)
        assert factor.inverted
    inverter.close()
