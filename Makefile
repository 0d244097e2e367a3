# mpisolve: `make demo` and `make test` work on a fresh machine with only Python 3.10+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
# A CPU build of torch, named exactly: a bare `torch` would pull a multi-GB CUDA build.
# Off these machines, add `--index-url https://download.pytorch.org/whl/cpu` via TORCH_PIP_ARGS.
TORCH          ?= torch==2.13.0
TORCH_PIP_ARGS ?= $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
NP             ?= 4
# A hung MPI run ends after this many seconds (MPICH's mpiexec honours it).
export MPIEXEC_TIMEOUT ?= 900
# Pytest under MPI: a test that hangs fails after this many seconds.
TEST_TIMEOUT   ?= 240
MPIRUN  := $(BIN)/mpiexec
PYTEST  := -m pytest -p no:cacheprovider --timeout=$(TEST_TIMEOUT) --timeout-method=thread

.PHONY: install demo test lint typecheck wheel-check test-serial test-mpi test-cluster docs perf clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH_PIP_ARGS) "$(TORCH)"
	$(BIN)/pip install -e '.[test,train,mpich,lint]'
	touch $@

install: $(VENV)/.installed

# Every solver on the same workload: 4 ranks, one of them a 4x straggler (--hetero straggler).
demo: install
	$(MPIRUN) -n $(NP) $(PY) -m mpi4py -m mpisolve compare --solvers all --model mlp --dataset digits \
		--epochs 5 --target-accuracy 0.95 --hetero straggler --out runs/demo

test: install lint typecheck wheel-check test-serial test-mpi test-cluster

# Lint and format check (ruff), configured in pyproject.toml.
LINTED := mpisolve kernels tests perf setup.py $(wildcard examples)
lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

# mypy on the package as it installs: kernels/ is mpisolve.kernels, so it is checked
# through a tree of links laid out that way (build/typecheck).
typecheck: install
	@rm -rf build/typecheck/mpisolve && mkdir -p build/typecheck/mpisolve
	@for f in mpisolve/*; do ln -s ../../../$$f build/typecheck/mpisolve/; done
	@ln -s ../../../kernels build/typecheck/mpisolve/kernels
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p mpisolve

# The wheel a user gets, installed without -e into a fresh venv and checked from outside
# the repository: every module imports, every command answers --help.
wheel-check: install
	rm -rf build/wheel && $(BIN)/pip wheel --no-deps -q -w build/wheel .
	$(PYTHON) -m venv build/wheel/venv
	build/wheel/venv/bin/pip install -q $(TORCH_PIP_ARGS) "$(TORCH)"
	build/wheel/venv/bin/pip install -q "$$(ls build/wheel/mpisolve-*.whl)[mpich]"
	cd "$$(mktemp -d)" && $(abspath build/wheel/venv/bin/python) $(abspath tests/installed_smoke.py) $(CURDIR)

# Without a GPU, tests/conftest.py runs the GPU kernels under Numba's CUDA simulator.
test-serial: install
	$(PY) $(PYTEST) -q tests -m "not mpi"

# Each size runs the MPI tests marked for it (see tests/conftest.py).
test-mpi: install
	@set -e; for n in 2 3 4 5 8; do \
		echo "== MPI tests at $$n ranks"; \
		$(MPIRUN) -n $$n $(PY) -m mpi4py $(PYTEST) -q --with-mpi -m mpi tests; \
	done

# An emulated 2-node cluster on this machine: tests/cluster/fake-ssh stands in for ssh, so
# MPI sees each -hosts group as a node (its own shared-memory split, the network between).
# At 2x2 and at 2x3 ranks, one job runs every MPI test marked `cluster` in CLUSTER_TESTS
# (the hierarchical sums against MPI's, node-shared buckets, one tensor's messages, the
# window solvers' inter-node path by detection, and the conformance suite's join, zeroing,
# clipping, GradScaler and no_sync for every solver); then tests/train/test_failures.py's checkpoint-resume job and
# one fault job (hogwild-sgd's rank killed) at 2x2.
CLUSTER := -launcher ssh -launcher-exec $(CURDIR)/tests/cluster/fake-ssh
CLUSTER_LAYOUTS := 2 3
CLUSTER_TESTS := tests/cluster tests/bench/test_sweep.py tests/comm/test_shm.py tests/comm/test_paths.py tests/comm/test_adasum_node.py tests/horovod/test_one_tensor.py tests/conformance tests/solvers/test_abs_sgd.py
test-cluster: install
	@set -e; for k in $(CLUSTER_LAYOUTS); do \
		echo "== MPI tests on the emulated cluster nodeA:$$k,nodeB:$$k"; \
		MPISOLVE_EMULATED_CLUSTER=1 $(MPIRUN) $(CLUSTER) -hosts nodeA:$$k,nodeB:$$k -n $$((2 * k)) \
			$(PY) -m mpi4py $(PYTEST) -q --with-mpi -m mpi $(CLUSTER_TESTS); \
	done
	MPISOLVE_TEST_HOSTS=nodeA:2,nodeB:2 $(PY) $(PYTEST) -q tests/train/test_failures.py -k "resumed or hogwild"

# The options tables of docs/solvers/*.md, regenerated in place from the options dataclasses
# (tests/test_docs.py fails when a table and the code differ).
docs: install
	$(PY) -m mpisolve.solvers.option_docs docs/solvers/*.md

# Every figure and table of the studies (docs/studies): each perf/*.sh in name order, from the repository
# root with PYTHON set to the venv's; results go under perf/results/<name>/. On a shared
# machine PERF_LOCK=/tmp/mpisolve-cpu.lock makes each MPI run hold that lock (flock) while
# it measures (perf/launch.py does it; a script running mpiexec itself prefixes
# ${PERF_LOCK:+flock $PERF_LOCK}).
export PERF_LOCK ?=
perf: install
	@set -e; for script in $(sort $(wildcard perf/*.sh)); do \
		echo "== $$script"; PYTHON=$(abspath $(PY)) bash $$script; \
	done

clean:
	rm -rf $(VENV) build *.egg-info runs
