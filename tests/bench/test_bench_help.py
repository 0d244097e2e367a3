"""``mpisolve bench --help`` lists every benchmark with its one line (no MPI started)."""

import subprocess
import sys

from mpisolve.bench import BENCHES


def test_bench_help_lists_every_benchmark_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "mpisolve", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    listed = {}
    for line in done.stdout.splitlines():
        words = line.split(maxsplit=1)
        if len(words) == 2 and words[0] in BENCHES:
            listed[words[0]] = words[1].strip()
    assert listed == {name: help_text for name, (_, help_text) in BENCHES.items()}
    assert all(help_text and "\n" not in help_text for _, help_text in BENCHES.values())
