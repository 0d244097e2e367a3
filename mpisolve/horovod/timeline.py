"""``HOROVOD_TIMELINE``: a Chrome-trace timeline of each collective (rank 0 writes it).

Each collective is a row named after it (``allreduce.<name>``), with two spans: the
negotiation (``NEGOTIATE_ALLREDUCE``: from the call until every rank's header has
arrived) and the communication (``ALLREDUCE``: the data round). Open the file in
``chrome://tracing`` or Perfetto. mpisolve has no background cycle, so ``mark_cycles``
marks nothing.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from ..comm.ops import Call, TensorOps


class Timeline:
    """Records the collectives of the engines it watches and writes them as a JSON array."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.write = rank == 0
        self._rows: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._watched: list[TensorOps] = []

    def watch(self, ops: TensorOps) -> None:
        """Record the collectives of ``ops`` from now on."""
        if self.write and self.observe not in ops.observers:
            ops.observers.append(self.observe)
            self._watched.append(ops)

    def observe(self, pending: Call, phase: str) -> None:
        now = time.time() * 1e6
        label = f"{pending.kind}.{pending.name}" if pending.name else pending.kind
        activity = pending.kind.upper()
        with self._lock:
            row = self._rows.get(label)
            if row is None:
                row = self._rows[label] = len(self._rows) + 1
                self._events.append({"name": "process_name", "ph": "M", "pid": row, "args": {"name": label}})
                self._events.append({"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}})
            if phase == "negotiating":
                self._events.append({"name": f"NEGOTIATE_{activity}", "ph": "B", "ts": now, "pid": row, "tid": 1})
            elif phase == "communicating":
                self._events.append({"ph": "E", "ts": now, "pid": row, "tid": 1})
                self._events.append({"name": activity, "ph": "B", "ts": now, "pid": row, "tid": 1})
            else:
                self._events.append({"ph": "E", "ts": now, "pid": row, "tid": 1})

    def stop(self) -> None:
        """Stop recording and write the file (``start_time_since_epoch_in_micros`` in its metadata)."""
        for ops in self._watched:
            ops.observers.remove(self.observe)
        self._watched.clear()
        if not self.write:
            return
        with self._lock:
            start = min((e["ts"] for e in self._events if "ts" in e), default=time.time() * 1e6)
            meta = {"name": "start_time_since_epoch_in_micros", "ph": "M", "pid": 0, "args": {"value": start}}
            with open(self.path, "w") as f:
                json.dump([meta, *self._events], f)
