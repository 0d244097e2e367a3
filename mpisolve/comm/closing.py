"""Ranks that stop at different steps: close() announces itself, and waits in a step look.

A synchronous solver's steps are collective rounds: every rank must take the same
number. A rank whose data runs out early (without ``solver.join()``) reaches ``close()``
while the others wait in a round it will never join. :class:`CloseNotices` turns that
hang into an error on every rank within a poll: ``close()`` sends every other rank a
notice (its rank and rounds completed) on a private duplicate of the communicator, and
every wait inside a round tests for notices (the communicator's ``interrupts``). A rank
waiting in a round that a closed rank never entered raises :class:`PeerClosed`; then,
in ``close()``, the ranks compare their rounds and the ranks that closed early raise
:class:`UnevenSteps`. The normal path costs one probe per poll of a wait that is not yet done.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..errors import PeerClosed
from .communicator import Communicator

_TAG = 1


@dataclass(frozen=True)
class Closing:
    """One rank's state at ``close()``: rounds completed; whether it entered the next one
    (started a collective of it, or its step: an error may have ended it there); whether it
    left collectives of it in flight; whether a peer's notice interrupted one of its waits."""

    rounds: int
    entered: bool
    busy: bool
    interrupted: bool


class CloseNotices:
    """The close notices of one solver on ``comm`` (collective to build: it duplicates ``comm``).

    ``round_now()``: the round this rank is waiting in, or None outside a round (waits
    outside a round are never interrupted: what they wait for, every rank started).
    ``solver`` and ``unit`` ("steps", "averages") name things in the messages.
    """

    def __init__(self, comm: Communicator, round_now: Callable[[], int | None], solver: str, unit: str) -> None:
        self.comm = comm
        self._round_now = round_now
        self._solver = solver
        self._unit = unit
        self._mpi = comm.comm.Dup()
        self._inbox = np.zeros(5, dtype=np.int64)
        self._status = MPI.Status()
        self._received: dict[int, Closing] = {}
        #: True once a notice interrupted one of this rank's waits.
        self.interrupted = False
        comm.interrupts.append(self.check)

    def _receive(self) -> None:
        # Probed, not posted: a solver never closed leaves no receive behind.
        while self._mpi.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=self._status):
            self._mpi.Recv([self._inbox, MPI.INT64_T], source=self._status.Get_source(), tag=_TAG)
            rank, rounds, entered, busy, interrupted = (int(v) for v in self._inbox)
            self._received[rank] = Closing(rounds, bool(entered), bool(busy), bool(interrupted))

    def peer_closed(self) -> bool:
        """Whether another rank has reached ``close()`` (its notice arrived)."""
        self._receive()
        return bool(self._received)

    def check(self) -> None:
        """Between polls of a wait: raise :class:`PeerClosed` if a rank that closed never entered this round.

        A rank that closed inside this round (an error ended its step) may have taken part
        in what this wait waits for: that wait goes on (ended, if not, by the watchdog).
        """
        here = self._round_now()
        if here is None:
            return
        self._receive()
        early = sorted(
            rank for rank, c in self._received.items() if c.rounds < here or (c.rounds == here and not c.entered)
        )
        if early:
            self.interrupted = True
            first = self._received[early[0]]
            raise PeerClosed(
                f"mpisolve {self._solver}: rank {_list(early)} reached close() after {first.rounds} {self._unit} "
                f"while rank {self.comm.rank} waits in {self._unit[:-1]} {here + 1}: the ranks ran different numbers "
                f"of {self._unit}. {_ADVICE}"
            )

    def close(self, rounds: int, entered: bool, busy: bool) -> dict[int, Closing]:
        """Collective: tell every other rank this one closes, and learn every rank's :class:`Closing`."""
        self.comm.interrupts.remove(self.check)
        me = self.comm.rank
        note = np.array([me, rounds, int(entered), int(busy), int(self.interrupted)], dtype=np.int64)
        sends = [
            self._mpi.Isend([note, MPI.INT64_T], dest=rank, tag=_TAG) for rank in range(self.comm.size) if rank != me
        ]

        def all_received() -> bool:
            self._receive()
            return len(self._received) == self.comm.size - 1

        def missing() -> str:
            ranks = [r for r in range(self.comm.size) if r != me and r not in self._received]
            return f"{self._solver} close(): ranks {_list(ranks)} to reach close() too"

        self.comm.wait_for(all_received, missing)
        self.comm.wait(sends, f"{self._solver} close notices")
        self._mpi.Free()
        return {**self._received, me: Closing(rounds, entered, busy, self.interrupted)}

    def verdict(self, table: dict[int, Closing]) -> str | None:
        """The error every rank raises after :meth:`close` gave ``table``, or None.

        Rounds that differ: every rank raises. Equal rounds after a rank was interrupted
        (a rank closed while another waited in the round after): the ranks that were not
        interrupted raise, unless they are closing because of an error of their own.
        """
        rounds = {c.rounds for c in table.values()}
        interrupted = sorted(r for r, c in table.items() if c.interrupted)
        if len(rounds) == 1 and not interrupted:
            return None
        me = self.comm.rank
        if len(rounds) == 1 and (me in interrupted or sys.exc_info()[1] is not None):
            return None
        by_count: dict[int, list[int]] = {}
        for rank, c in sorted(table.items()):
            by_count.setdefault(c.rounds + int(c.interrupted), []).append(rank)
        parts = [f"rank {_list(ranks)}: {count}" for count, ranks in sorted(by_count.items())]
        return (
            f"mpisolve {self._solver}: the ranks ran different numbers of {self._unit} before close() "
            f"({'; '.join(parts)}, counting a round left waiting). {_ADVICE}"
        )


_ADVICE = (
    "Wrap the training loop in `with solver.join():` (ranks whose data runs out early then take part "
    "in the others' remaining rounds, contributing nothing), or give every rank the same number of batches."
)


def _list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) < 8 else f"{','.join(map(str, ranks[:8]))},..."
