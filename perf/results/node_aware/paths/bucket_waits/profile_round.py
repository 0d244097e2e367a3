import cProfile, pstats, sys, torch, mpisolve
from mpisolve.comm.buckets import GradientBuckets
comm = mpisolve.init()
p = torch.nn.Parameter(torch.zeros(1024))
g = GradientBuckets([p], comm, bucket_bytes=4096, average=True)
def run(n):
    for _ in range(n):
        g.rearm(); g.finish()
run(200)
pr = cProfile.Profile()
pr.enable(); run(5000); pr.disable()
if comm.rank == 0:
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
g.close()
