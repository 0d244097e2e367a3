"""A pytest plugin (``-p suite_log``): each test's outcome on this rank, written as it ends.

perf/horovod_suite.py reads these lines (``$HOROVOD_SUITE_LOG-<rank>.jsonl``) rather than
JUnit files, which pytest writes only at its end: a rank that is killed (the others
finished while it waited in a collective they had left) keeps its results so far.
"""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("HOROVOD_SUITE_LOG")
    if not path or not (report.when == "call" or report.failed or report.skipped):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else ""
    first = message.splitlines()[0][:160] if message else ""
    line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome, "message": first}
    with open(f"{path}-{os.environ.get('PMI_RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
