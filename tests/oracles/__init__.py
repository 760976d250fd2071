"""The tests' NumPy oracles, written from docs/numerics.md and the authors' code, never from
fp4lab's (they import only NumPy), with their shared conventions in one place:

* :mod:`oracles.f32`: float32 arithmetic, one IEEE rounding (nearest-even) per operation,
  and the emulation of XLA:CPU's DAZ/FTZ (``ftz32``, ``Arith(ftz)``); sums in a stated
  order;
* :mod:`oracles.numpy_ref`: fp4lab's own numerics specification (element codecs in exact
  float64 arithmetic, every block format);
* :mod:`oracles.papers`: the published quantizers, each ported from its authors' kernel with
  the authors' own special-value rules (they differ from the specification's, and are kept
  separate).

tests/test_numpy_ref.py tests them (against ml_dtypes, NumPy's float16, hand-checked values).
"""
