"""Lets PyPI's torchvision wheel import beside a CPU-only torch (perf/horovod_examples.sh).

PyPI's torchvision 0.28.0 links its compiled operators against libtorch_cuda, which the CPU
build of torch lacks, so they do not load; torchvision then still registers fake kernels
for ``torchvision::nms`` and ``qnms`` and fails to import ("operator torchvision::nms does
not exist"). Where its operators library does not load, this declares those two
operators' schemas, with no kernel (Horovod's examples never call them), so that its
models, datasets and transforms import. Where the library loads, it does nothing.
"""

import importlib.util
import os

import torch

_spec = importlib.util.find_spec("torchvision")
_library = None
if _spec is not None and _spec.origin is not None:
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(_spec.origin), "_C.so"))
    except OSError:
        _library = torch.library.Library("torchvision", "DEF")
        for _op in ("nms", "qnms"):
            _library.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
