"""Stateful recipe features: state a quantized GEMM keeps across training steps.

:mod:`fp4lab.features.protocol` is the protocol they share (build, init, mode, variables,
update) and :mod:`fp4lab.features.registry` the features a training run builds.
"""
