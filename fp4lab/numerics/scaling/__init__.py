"""Scale schemes: how a block's statistics become a stored scale and element multipliers.

A scheme is a small frozen dataclass with four operations, all on float32 arrays shaped like
the blocks (one entry per block, broadcastable against the elements):

* ``statistic(xb, axes)``: the block statistic (``max |x|`` by default).
* ``encode(xb, stat, outer, element, axes, u) -> (stored_scale, multiplier)``: the scale as
  stored (``storage``: E4M3, E8M0 byte, float32, float16) and the float32 multiplier applied
  to the elements before rounding (``v = fl(x * multiplier)``), from the block statistic,
  the outer amax (``outer_amax`` says where it comes from: a tensor, a slice, a group of
  blocks) and, for schemes that look at them, the block's elements ``xb``.
* ``dequantize(q, stored_scale, outer, element)``: the element values times the scheme's
  ``multipliers`` (``q * m1 (* m2)``, in that order: two factors where one could leave
  float32's normal range), or the scheme's own arithmetic (FP4 All the Way divides).
* ``round_nearest(v, element)``: the element rounding (RNE by default; GGML's own rules for
  its formats).

The arithmetic is written exactly as docs/numerics.md states it, one float32 operation per
``fl()``, in the order given there; every division is :func:`fp4lab.numerics.rounding.div`,
correctly rounded on GPUs too (XLA's GPU division is approximate). On XLA:CPU float32 subnormals are
flushed to zero (inputs and results): values and intermediates below 2**-126 in magnitude count as
zero. That matters only for tensors or blocks whose amax is below ~1e-35; see the notes in
``fp4lab.quantize``. Where an XLA rewrite could change a bit, the code defends it (``rounding.div``,
``rounding.opaque``, Q4_0's addition-free rounding): the audit in docs/numerics.md lists every site.
"""

from fp4lab.numerics.scaling import published, standard
from fp4lab.numerics.scaling.published import *  # noqa: F403
from fp4lab.numerics.scaling.standard import *  # noqa: F403

__all__ = standard.__all__ + published.__all__
