"""A pytest plugin (``-p no_muon``): ``torch.optim.Optimizer.__subclasses__()`` without Muon.

Horovod's tests that loop over every optimizer class (test_broadcast_state,
test_broadcast_state_options, test_force_allreduce) build each on a model with 1-D
biases; ``torch.optim.Muon`` (torch 2.9, after Horovod's last release) refuses those in
its constructor, in the test's own code. perf/horovod_suite.sh runs those tests once more
with this plugin, as on the torch they were written for; the headline counts are without it.
"""

import torch

_subclasses = type.__subclasses__


def _without_muon(cls):
    return [c for c in _subclasses(cls) if c.__name__ != "Muon"]


torch.optim.Optimizer.__subclasses__ = classmethod(_without_muon)  # type: ignore[method-assign,assignment]
