# Sourced by this directory's A/B scripts (run from the repository root): main's checkout and commit, the copy of
# $BEFORE in $BASE made to import its own kernels, the venv's Python and mpiexec, and the emulated cluster's launcher.
MAIN=$(pwd)
HERE=$MAIN/perf/results/node_aware/leader
AFTER=$(git rev-parse --short HEAD)
# The editable install maps mpisolve.kernels to main's kernels/; a link makes the copy import its own.
[ -e "$BASE/mpisolve/kernels" ] || ln -s ../kernels "$BASE/mpisolve/kernels"
PY=$MAIN/.venv/bin/python
MPIEXEC=$MAIN/.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec "$MAIN/tests/cluster/fake-ssh")
# mpiexec's arguments for a layout: n<ranks> on this machine, or the emulated 2x2 and 2x3 clusters.
layout_args() {
  case $1 in
    n*) echo "-n ${1#n}" ;;
    2x2) echo "${SSH[*]} -hosts a:2,b:2 -n 4" ;;
    2x3) echo "${SSH[*]} -hosts a:3,b:3 -n 6" ;;
  esac
}
# `python -m mpisolve ARGS...` with DIR's mpisolve, on a layout's ranks (as layout_args names it).
mpisolve_on() {  # dir layout args...
  local dir=$1 where
  read -ra where <<< "$(layout_args "$2")"
  shift 2
  (cd "$dir" && "$MPIEXEC" "${where[@]}" -env PYTHONPATH "$dir" "$PY" -m mpi4py -m mpisolve "$@")
}
