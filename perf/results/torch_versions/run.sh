#!/usr/bin/env bash
# The test suite on another torch release (docs/guide/install.md, "Which PyTorch"):
#   git worktree add WT main
#   python3 -m venv WT/.venv && WT/.venv/bin/pip install "torch==VERSION" [numpy<2]
#   WT/.venv/bin/pip install -e "WT[test,train,mpich]" [numpy<2]
#   bash perf/results/torch_versions/run.sh WT
# The stages are the Makefile's test-serial, test-mpi and test-cluster, each run under the
# CPU lock; every rank prints its own count.
cd "$1"
export MPIEXEC_TIMEOUT=900
PYTEST="-m pytest -p no:cacheprovider --timeout=240 --timeout-method=thread -q"
.venv/bin/python -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
echo "== serial"
flock /tmp/mpisolve-cpu.lock .venv/bin/python $PYTEST tests -m "not mpi" 2>&1 | grep -E "passed|failed|FAILED|ERROR"
for n in 2 3 4 5 8; do
  echo "== MPI tests at $n ranks"
  flock /tmp/mpisolve-cpu.lock .venv/bin/mpiexec -n $n .venv/bin/python -m mpi4py $PYTEST --with-mpi -m mpi tests 2>&1 | grep -E "passed|failed|FAILED|ERROR" | sort -u
done
for k in 2 3; do
  echo "== emulated nodeA:$k,nodeB:$k"
  MPISOLVE_EMULATED_CLUSTER=1 flock /tmp/mpisolve-cpu.lock .venv/bin/mpiexec -launcher ssh -launcher-exec "$1/tests/cluster/fake-ssh" -hosts nodeA:$k,nodeB:$k -n $((2*k)) .venv/bin/python -m mpi4py $PYTEST --with-mpi -m mpi tests/cluster tests/comm/test_shm.py tests/comm/test_paths.py tests/comm/test_adasum_node.py tests/conformance tests/solvers/test_abs_sgd.py 2>&1 | grep -E "passed|failed|FAILED|ERROR" | sort -u
done
echo "== resume and fault jobs"
MPISOLVE_TEST_HOSTS=nodeA:2,nodeB:2 flock /tmp/mpisolve-cpu.lock .venv/bin/python $PYTEST tests/train/test_failures.py -k "resumed or hogwild" 2>&1 | grep -E "passed|failed|FAILED|ERROR"
