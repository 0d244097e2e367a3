"""The conformance suite's communicator: one per test module, with a short watchdog, so that
an idiom that would hang fails the test (CommTimeout) instead."""

from __future__ import annotations

import pytest

from mpisolve.comm.communicator import Communicator

#: Seconds before a wait in these tests gives up (every idiom here completes in well under one).
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def comm() -> Communicator:
    return Communicator(timeout_s=TIMEOUT_S)
