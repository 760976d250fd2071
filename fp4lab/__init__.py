"""fp4lab: low-precision training numerics for JAX.

The core is here: formats, ``quantize``/``dequantize``/``fake_quant``, ``QArray``, recipes, the
quantized GEMMs, policies, probes and metrics (``fp4lab.quantize``, ``fp4lab.Recipe``,
``fp4lab.nemotron3``, ...); :mod:`fp4lab.flax` is the Flax integration (``quantize_model``).
Study tools live in their own modules, imported by name: ``fp4lab.saved`` (``recompute``),
``fp4lab.attention`` (``flash_attention``), ``fp4lab.reduction``, ``fp4lab.mismatch`` and
``fp4lab.export`` (``export.load``), and ``fp4lab.qdot.saved_bytes``.
The modules, from the bottom up: ``formats`` (number formats as data), ``rounding`` (grids,
exact division, packing), ``scaling`` (scale schemes), ``qarray`` (the QArray pytree),
``backend`` (the kernel table), ``quantize`` (quantize, dequantize, fake_quant), ``metrics``,
``hadamard``, ``delayed`` (FP8 amax histories), ``outcontrol`` (TetraJet-v2's outlier
channels) and ``osci_reset`` (its oscillation reset), ``recipe`` (the six GEMM operands and how each
is quantized), ``probes``, ``einsum`` and ``canonical`` (dimension numbers as one canonical
GEMM), ``operand_quant`` (how every core GEMM quantizes its six operands), ``qdot`` (the
quantized GEMM and the features composed around it) and ``policy`` (rules from module paths
to recipes). Beyond the GEMM operands (docs/beyond_the_gemms.md):
``saved`` (what is stored for the backward pass; ``recompute``), ``attention``
(flash-style attention with its BF16 rounding points), ``reduction``
(gradient-reduction precision) and ``mismatch`` (train/inference mismatch of rollouts);
``export`` writes quantized weights as GGUF, MXFP4 and NVFP4 checkpoints (docs/export.md).
"""

from fp4lab.formats import FORMATS, Format, format_names, get_format
from fp4lab.metrics import quant_metrics
from fp4lab.policy import (
    PrecisionPolicy,
    Rule,
    explain,
    get_policy,
    load_policy,
    nemotron3,
    save_policy,
)
from fp4lab.probes import probe_table, probe_zeros
from fp4lab.qarray import QArray
from fp4lab.qdot import qdot_general, qeinsum
from fp4lab.quantize import dequantize, fake_quant, quantize
from fp4lab.recipe import RECIPES, OperandQuant, Recipe, get_recipe, recipe_names

__version__ = "0.1.0"

# what a user needs to quantize, run a GEMM under a recipe and govern a model by a policy;
# the rest by module (fp4lab.formats.ELEMENTS, fp4lab.outcontrol.OutControl, fp4lab.policy.Depth,
# fp4lab.metrics.METRIC_NAMES, fp4lab.hadamard.rht, fp4lab.backend.KernelFallback, ...)
__all__ = [
    # formats and quantizers
    "FORMATS", "Format", "format_names", "get_format", "QArray", "quantize", "dequantize",
    "fake_quant",
    # numerics
    "quant_metrics", "probe_zeros", "probe_table",
    # GEMMs and recipes
    "qdot_general", "qeinsum", "Recipe", "OperandQuant", "RECIPES", "get_recipe",
    "recipe_names",
    # policies
    "PrecisionPolicy", "Rule", "nemotron3", "explain", "get_policy", "load_policy",
    "save_policy",
]
