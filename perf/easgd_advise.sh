#!/usr/bin/env bash
# The measured figures advise rests on (docs/guide/cli.md#advise-which-solver-for-your-model), from the EASGD study's
# results (perf/easgd.sh runs first: name order). No measurement.
# -> mpisolve/studies.json
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/advise_studies.py
