"""``bench sweep``: OSU-style allreduce latency and bus bandwidth over message sizes.

For each message size (float32 bytes, ``--min-bytes`` to ``--max-bytes`` by ``--factor``)
and each operation:

- ``mpi``: one blocking ``MPI_Allreduce`` (sum) from a send to a receive buffer, as
  osu_allreduce does: the MPI library's own figure.
- ``sum``, ``average``: ``mpisolve.allreduce(t, op=...)`` of the one tensor, the functional
  collective (:mod:`mpisolve.comm.onetensor`: one node-shared round where node-shared sums
  apply, else one MPI allreduce, its signature checked in the same message). With both in
  ``--ops``, ``average`` runs on a communicator of its own, so that each op's calls are of its
  signature alone (on one communicator the two would go round a cycle the ranks learn first).
- ``bucketed``: the solvers' gradient path, ``GradientBuckets.finish()`` (averaging) on one
  bucket (a persistent allreduce, then the average).
- ``adasum``: ``mpisolve.allreduce([t], op="adasum")`` (in the default ``--ops`` wherever the
  functional collective offers that op).
- ``bucketed-node``, ``bucketed-mpi`` (not in the default ``--ops``): ``bucketed`` with its sums
  in node-shared memory at every size, and on MPI's path at every size, whatever the crossover
  (:attr:`.shm.NodeGroup.min_bytes`). With both, rank 0 also prints the crossover measured on
  this layout: the smallest size from which the node-shared buckets are no slower than MPI's
  path at every larger size measured, the ``MPISOLVE_NODE_SHM_MIN_BYTES`` to set for it
  (``crossover_bytes`` in the JSON; None where MPI's path was faster at the largest size),
  beside the layout's default (``default_crossover_bytes``) and the sizes at which the
  node-shared buckets were no slower (``node_no_slower_bytes``).
  ``bucketed-node`` needs node-shared sums on this layout (several ranks per node).

Each operation's result is checked once per size before it is timed, against the exact
reduction of known inputs (for Adasum, orthogonal ones, whose Adasum is their sum). The
operations of one size are timed in turn within each repeat, so that load from outside
falls on all of them alike and their ratios hold. The
latency is the median over repeats of the slowest rank's time for one call; the
bandwidths are nccl-tests': ``algbw = bytes / time`` and
``busbw = algbw * 2(n-1)/n`` (the bytes each rank's links carry in a ring allreduce).
With ``mpi`` among the operations, rank 0 also prints on stderr each other operation's
latency over ``mpi``'s at every size, naming the layout (nodes, ranks per node), and the
JSON holds them (``ratios``): the per-layout tables of docs/studies/node-aware.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mpi4py import MPI

from ..comm.buckets import GradientBuckets
from ..comm.collectives import REDUCE_OPS, allreduce
from ..comm.communicator import Communicator, mpi_buffer
from ..comm.ops import allreduce as one_allreduce
from ..comm.shm import node_group
from ..errors import InputError
from . import interleaved_medians, write_csv

#: Operations every mpisolve has; "adasum" joins when the functional collective offers it.
BASE_OPS = ("mpi", "sum", "average", "bucketed")
#: The bucket path forced to node-shared memory, and to MPI's path, at every size (asked for by name).
PATH_OPS = ("bucketed-node", "bucketed-mpi")
#: Messages up to this size are timed ``--small-repeats`` times (OSU also repeats small ones more).
SMALL_BYTES = 64 * 1024
CSV_FIELDS = ("ranks", "op", "bytes", "latency_us", "algbw_GBps", "busbw_GBps", "repeats")
ELEMENT_BYTES = 4  # float32
BYTE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def available_ops() -> tuple[str, ...]:
    return BASE_OPS + (("adasum",) if "adasum" in REDUCE_OPS else ())


def parse_bytes(text: str) -> int:
    """``4``, ``64K``, ``64M``, ``1G`` (binary multiples) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 4, 64K, 64M)")
    return int(match.group(1)) * BYTE_UNITS[match.group(2).upper()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ops",
        default=",".join(available_ops()),
        help=f"comma-separated operations (default: {','.join(available_ops())}; "
        "'adasum' needs mpisolve.allreduce(op='adasum'); add bucketed-node,bucketed-mpi to measure this layout's "
        "crossover)",
    )
    parser.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest message (default 4)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 * 1024**2, help="largest message (default 64M)")
    parser.add_argument("--factor", type=int, default=4, help="size step: each message is this many times the last")
    parser.add_argument(
        "--small-repeats",
        type=int,
        default=100,
        help=f"timed repeats for messages up to {SMALL_BYTES // 1024} KiB (--repeats above)",
    )
    parser.add_argument("--csv", help="rank 0 also writes the rows to this CSV file")


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes < ELEMENT_BYTES or min_bytes % ELEMENT_BYTES:
        raise InputError(f"--min-bytes must be a positive multiple of {ELEMENT_BYTES} (float32), got {min_bytes}")
    if max_bytes < min_bytes:
        raise InputError(f"--max-bytes ({max_bytes}) is below --min-bytes ({min_bytes})")
    if factor < 2:
        raise InputError(f"--factor must be >= 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def parse_ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    if not ops:
        raise InputError("--ops is empty")
    for op in ops:
        if op not in BASE_OPS + PATH_OPS + ("adasum",):
            choices = ", ".join(available_ops() + PATH_OPS)
            raise InputError(f"unknown op {op!r} in --ops (choose from {choices})")
        if op not in available_ops() + PATH_OPS:
            raise InputError(
                "--ops adasum needs mpisolve.allreduce(op='adasum'), which this mpisolve does not have yet"
            )
    return ops


@dataclass
class Case:
    """One operation on one message: ``run`` it, then ``result()`` should equal ``want``."""

    run: Callable[[], None]
    result: Callable[[], torch.Tensor]
    want: torch.Tensor
    close: Callable[[], None] = lambda: None


def make_case(op: str, numel: int, comm: Communicator) -> Case:
    """Rank r's input is ``(r + 1) * pattern``; ``want`` is the exact reduction of all inputs."""
    pattern = (torch.arange(numel) % 5 + 1).float()
    data = pattern * (comm.rank + 1)
    total = comm.size * (comm.size + 1) / 2
    if op == "mpi":
        recv = torch.empty_like(data)
        send_spec, recv_spec = mpi_buffer(data), mpi_buffer(recv)
        return Case(lambda: comm.comm.Allreduce(send_spec, recv_spec, MPI.SUM), lambda: recv, pattern * total)
    if op in ("sum", "average", "adasum"):
        want = pattern * (total if op == "sum" else total / comm.size)
        if op == "adasum":
            # Orthogonal inputs (rank r keeps the elements i with i % size == r): Adasum
            # of orthogonal vectors is their sum, whatever order it combines them in.
            mine = torch.arange(numel) % comm.size
            data *= mine == comm.rank
            want = pattern * (mine + 1)
        out: list[torch.Tensor] = []

        def functional() -> None:  # one tensor, as users call it (Adasum's list: its functional path)
            out[:] = allreduce([data], op=op, comm=comm) if op == "adasum" else [one_allreduce(data, op=op, comm=comm)]

        return Case(functional, lambda: out[0], want)
    param = torch.nn.Parameter(torch.zeros_like(data))  # the bucketed ops, on the path ``comm`` gives them
    grads = GradientBuckets([param], comm, bucket_bytes=data.numel() * data.element_size(), average=True)
    assert param.grad is not None  # GradientBuckets made it a view into its bucket
    param.grad.copy_(data)

    def bucketed() -> None:
        grads.rearm()
        grads.finish()

    def reduced() -> torch.Tensor:  # node-shared buckets: the sum in the window, not the slot
        assert param.grad is not None
        return param.grad

    # After the first call every rank holds the average, which further averages keep.
    return Case(bucketed, reduced, pattern * total / comm.size, grads.close)


def check(case: Case, op: str, comm: Communicator) -> None:
    """Run ``case`` once and compare with the exact reduction of the ranks' inputs."""
    case.run()
    if not torch.allclose(case.result(), case.want, rtol=1e-5, atol=0):
        nbytes = case.want.numel() * ELEMENT_BYTES
        raise RuntimeError(f"bench sweep: {op} of {nbytes} bytes gave a wrong result on rank {comm.rank}")


def path_communicators(ops: list[str], comm: Communicator) -> dict[str, Communicator]:
    """Communicators of ``comm``'s ranks for the ops that force a path: node-shared sums at every
    size (``bucketed-node``; an InputError, on every rank, where they do not apply), MPI's path;
    and for ``average`` beside ``sum``, so that each keeps its own agreed signature."""
    forced: dict[str, Communicator] = {}
    if {"sum", "average"} <= set(ops):
        forced["average"] = Communicator(comm.comm)
    if "bucketed-node" in ops:
        node = forced["bucketed-node"] = Communicator(comm.comm, node_shm=True)
        group = node_group(node)
        if group is None or node.stage_all:
            node.free()
            raise InputError(
                "--ops bucketed-node needs node-shared sums on this layout: several ranks on every node, the same "
                "number on each, tensors not staged (MPISOLVE_STAGE)"
            )
        group.min_bytes = 0  # node-shared at every size, whatever the crossover
    if "bucketed-mpi" in ops:
        forced["bucketed-mpi"] = Communicator(comm.comm, node_shm=False)
    return forced


def timed_rows(
    ops: list[str], sizes: list[int], args: argparse.Namespace, comm: Communicator, forced: dict[str, Communicator]
) -> list[dict[str, Any]]:
    """Each op's checked, timed row at each size (the forced ops on their own communicators)."""
    rows = []
    for nbytes in sizes:
        repeats = args.small_repeats if nbytes <= SMALL_BYTES else args.repeats
        cases: dict[str, Case] = {}
        try:
            for op in ops:
                cases[op] = make_case(op, nbytes // ELEMENT_BYTES, forced.get(op, comm))
                check(cases[op], op, comm)
            timings = interleaved_medians({op: case.run for op, case in cases.items()}, comm, repeats, args.warmup)
        finally:
            for case in cases.values():
                case.close()
        for op, seconds in timings.items():
            algbw = nbytes / seconds / 1e9
            rows.append(
                {
                    "ranks": comm.size,
                    "op": op,
                    "bytes": nbytes,
                    "latency_us": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (comm.size - 1) / comm.size,
                    "repeats": repeats,
                }
            )
    return rows


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    ops = parse_ops(args.ops)
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    if args.small_repeats < 1:
        raise InputError("--small-repeats must be >= 1")
    load_before = os.getloadavg()[0]
    forced = path_communicators(ops, comm)
    try:
        rows = timed_rows(ops, sizes, args, comm, forced)
    finally:
        for forced_comm in forced.values():
            forced_comm.free()
    if args.csv and comm.rank == 0:
        write_csv(args.csv, rows, CSV_FIELDS)
    layout = f"{comm.nodes} node(s) x {comm.local_size} ranks" if comm.nodes > 1 else f"one node, {comm.size} ranks"
    ratios = ratios_to_mpi(rows)
    if ratios and comm.rank == 0:
        print(ratio_table(layout, ratios), file=sys.stderr, flush=True)
    # The machine's 1-minute load (this run's own ranks included) before and after: a
    # load well above the rank count means other work shared the cores and the figures.
    result = {
        "bench": "sweep",
        "ranks": comm.size,
        "mpi_library": comm.library_version(),
        "load_average": [load_before, os.getloadavg()[0]],
        "ops": ops,
        "layout": layout,
        "nodes": comm.nodes,
        "ranks_per_node": comm.local_size,
        "ratios": ratios,
        "rows": rows,
    }
    if set(PATH_OPS) <= set(ops):
        group = node_group(comm)
        result["crossover_bytes"] = measured = measured_crossover(rows)
        result["default_crossover_bytes"] = default = group.min_bytes if group is not None else None
        result["node_no_slower_bytes"] = no_slower = no_slower_sizes(rows)
        if comm.rank == 0:
            print(crossover_line(layout, measured, default, no_slower), file=sys.stderr, flush=True)
    return result


def ratios_to_mpi(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Each operation's latency over flat MPI's (``mpi``) at each size; empty without ``mpi``."""
    mpi = {row["bytes"]: row["latency_us"] for row in rows if row["op"] == "mpi"}
    ratios: dict[str, dict[int, float]] = {}
    for row in rows:
        if row["op"] != "mpi" and row["bytes"] in mpi:
            ratios.setdefault(row["op"], {})[row["bytes"]] = row["latency_us"] / mpi[row["bytes"]]
    return ratios


def ratio_table(layout: str, ratios: dict[str, dict[int, float]]) -> str:
    """The ratios as a text table: a row per size, a column per operation (``*``: slower than MPI)."""
    ops = list(ratios)
    sizes = sorted({size for by_size in ratios.values() for size in by_size})
    widths = [max(12, len(op) + 2) for op in ops]
    lines = [
        f"bench sweep, {layout}: latency / flat MPI_Allreduce",
        "bytes".rjust(10) + "".join(f"{op:>{width}}" for op, width in zip(ops, widths)),
    ]
    for size in sizes:
        cells = []
        for op in ops:
            ratio = ratios[op].get(size)
            cells.append("-" if ratio is None else f"{ratio:.2f}x" + ("*" if ratio > 1 else " "))
        lines.append(f"{size:>10}" + "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths)))
    return "\n".join(lines)


def measured_crossover(rows: list[dict[str, Any]]) -> int | None:
    """From rows of both ``PATH_OPS``: the smallest size from which ``bucketed-node`` is no slower than
    ``bucketed-mpi`` at that size and every larger one (0 where that is every size measured; None where
    it is slower at the largest)."""
    sizes = sorted(row["bytes"] for row in rows if row["op"] == "bucketed-node")
    no_slower = set(no_slower_sizes(rows))
    crossover: int | None = None
    for size in reversed(sizes):
        if size not in no_slower:
            break
        crossover = size
    return 0 if crossover == sizes[0] else crossover


def no_slower_sizes(rows: list[dict[str, Any]]) -> list[int]:
    """The sizes at which ``bucketed-node`` was no slower than ``bucketed-mpi``."""
    mpi = {row["bytes"]: row["latency_us"] for row in rows if row["op"] == "bucketed-mpi"}
    return sorted(r["bytes"] for r in rows if r["op"] == "bucketed-node" and r["latency_us"] <= mpi[r["bytes"]])


def crossover_line(layout: str, measured: int | None, default: int | None, no_slower: list[int]) -> str:
    """What the measured crossover tells a user of this layout to set (``no_slower``: :func:`no_slower_sizes`)."""
    now = f"(this layout's default: {default})" if default is not None else "(node-shared sums do not apply here)"
    if measured is None:
        where = ", ".join(map(str, no_slower)) or "none"
        return (
            f"bench sweep, {layout}: MPI's path was faster than node-shared buckets at the largest size measured "
            f"(node-shared no slower at: {where}): no crossover below it; buckets that large keep MPI's path with "
            f"MPISOLVE_NODE_SHM=0 {now}"
        )
    return (
        f"bench sweep, {layout}: node-shared buckets no slower than MPI's path from {measured} bytes up: "
        f"MPISOLVE_NODE_SHM_MIN_BYTES={measured} {now}"
    )
