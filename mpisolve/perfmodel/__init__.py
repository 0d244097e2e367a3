"""A performance model of the solvers: alpha-beta-gamma collectives, calibrated from
``bench sweep``, projecting iteration time and efficiency to many GPUs (``mpisolve model``)."""
