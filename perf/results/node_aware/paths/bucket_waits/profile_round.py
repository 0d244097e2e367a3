"""cProfile of 5,000 gradient-bucket rounds (rearm + finish, average, one 4 KiB bucket) on rank 0.

mpiexec -launcher ssh -launcher-exec tests/cluster/fake-ssh -hosts a:2,b:2 -n 4 python profile_round.py
"""

import cProfile
import pstats

import torch

import mpisolve
from mpisolve.comm.buckets import GradientBuckets

comm = mpisolve.init()
param = torch.nn.Parameter(torch.zeros(1024))
grads = GradientBuckets([param], comm, bucket_bytes=4096, average=True)


def run(rounds: int) -> None:
    for _ in range(rounds):
        grads.rearm()
        grads.finish()


run(200)
profile = cProfile.Profile()
profile.enable()
run(5000)
profile.disable()
if comm.rank == 0:
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
grads.close()
