"""Compute kernels, installed as ``mpisolve.kernels``, organised by operation.

Each operation module (``fused``, ``adasum``, ``inverse``, ``elastic``) holds a CPU
implementation (Numba, parallel where it pays) and a GPU twin (``numba.cuda`` kernels on
memory exposed through ``__cuda_array_interface__``, or CuPy where a library routine
exists), and one public function that picks between them by the tensors' device through
:func:`mpisolve.kernels.dispatch.by_device`. GPU modules are imported only when a GPU
tensor is seen, so this package imports and works without CuPy or a CUDA driver.
"""
