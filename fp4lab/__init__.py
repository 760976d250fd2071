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
is quantized), ``probes``, ``einsum``, ``qdot`` (the quantized GEMMs) and ``policy`` (rules
from module paths to recipes). Beyond the GEMM operands (docs/beyond_the_gemms.md):
``saved`` (what is stored for the backward pass; ``recompute``), ``attention``
(flash-style attention with its BF16 rounding points), ``reduction``
(gradient-reduction precision) and ``mismatch`` (train/inference mismatch of rollouts);
``export`` writes quantized weights as GGUF, MXFP4 and NVFP4 checkpoints (docs/export.md).
"""

from fp4lab.backend import KernelFallback
from fp4lab.delayed import DelayedScaling
from fp4lab.formats import ELEMENTS, FORMATS, ElementFormat, Format, format_names, get_format
from fp4lab.hadamard import rht
from fp4lab.metrics import METRIC_NAMES, quant_metrics
from fp4lab.policy import (
    Depth,
    PolicyWarning,
    PrecisionPolicy,
    Rule,
    all_layers,
    explain,
    get_policy,
    load_policy,
    nemotron3,
    nvfp4_paper,
    save_policy,
)
from fp4lab.probes import probe_table, probe_zeros
from fp4lab.qarray import QArray
from fp4lab.qdot import qdot_general, qeinsum
from fp4lab.quantize import dequantize, fake_quant, quantize
from fp4lab.recipe import (OPERANDS, RECIPES, OperandQuant, OutControl, Recipe, SavedX,
                           get_recipe, recipe_names)

__version__ = "0.1.0"

__all__ = [
    # formats and quantizers
    "ELEMENTS", "FORMATS", "ElementFormat", "Format", "format_names", "get_format",
    "QArray", "quantize", "dequantize", "fake_quant", "rht", "KernelFallback",
    # numerics
    "quant_metrics", "METRIC_NAMES", "probe_zeros", "probe_table",
    # GEMMs and recipes
    "qdot_general", "qeinsum", "Recipe", "OperandQuant", "OPERANDS", "RECIPES", "get_recipe",
    "recipe_names", "DelayedScaling", "SavedX", "OutControl",
    # policies
    "PrecisionPolicy", "Rule", "Depth", "nemotron3", "nvfp4_paper", "all_layers", "explain",
    "get_policy", "load_policy", "save_policy", "PolicyWarning",
]
