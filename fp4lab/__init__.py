"""fp4lab: low-precision training numerics for JAX.

``import fp4lab`` gives what a user needs to quantize, run a GEMM under a recipe and govern a
model by a policy (``fp4lab.quantize``, ``fp4lab.qdot_general``, ``fp4lab.Recipe``,
``fp4lab.nemotron3``, ...); the rest is imported by module. The package's folders name its
layers, from the bottom up (imports point up, never down):

* ``fp4lab.numerics``: number formats as data (``formats``), rounding onto their grids
  (``rounding``), block geometry (``geometry``), scale schemes (``scaling``), the QArray
  pytree (``qarray``), quantize/dequantize/fake_quant (``quantize``), the Hadamard transform
  (``hadamard``), tensor metrics (``metrics``) and the kernel table (``backend``);
* ``fp4lab.gemm``: the six GEMM operands (``operands``) and how a recipe quantizes each
  (``recipe``), the canonical GEMM (``canonical``, ``einsum``), the operand quantization
  every core GEMM shares (``operand_quant``), the quantized GEMM with the features composed
  around it (``qdot``), the grouped GEMM of MoE experts (``grouped``: ``qragged_dot``,
  ``qexpert_einsum``) and what is stored for the backward pass (``saved``: ``recompute``);
* ``fp4lab.features``: stateful recipe features behind one protocol (``protocol``,
  ``registry``): FP8 amax histories (``delayed``), the probes (``probes``), TetraJet-v2's
  outlier channels (``outcontrol``) and oscillation reset (``osci_reset``);
* ``fp4lab.beyond``: precision beyond the GEMM operands (docs/beyond_the_gemms.md):
  ``attention`` (flash-style attention with its BF16 rounding points), ``reduction``
  (gradient-reduction precision), ``mismatch`` (train/inference mismatch of rollouts);
* ``fp4lab.policy`` (rules from module paths to recipes), then the integrations:
  ``fp4lab.flax`` (``quantize_model``), ``fp4lab.export`` (GGUF, MXFP4 and NVFP4 checkpoints,
  docs/export.md), ``fp4lab.integrations.maxtext`` and the ``fp4lab`` command (``cli``).
"""

from fp4lab.numerics.formats import FORMATS, Format, format_names, get_format
from fp4lab.numerics.metrics import quant_metrics
from fp4lab.policy import (
    PrecisionPolicy,
    Rule,
    explain,
    get_policy,
    load_policy,
    nemotron3,
    save_policy,
)
from fp4lab.features.probes import probe_table, probe_zeros
from fp4lab.numerics.qarray import QArray
from fp4lab.gemm.grouped import qexpert_einsum, qragged_dot
from fp4lab.gemm.qdot import qdot_general, qeinsum
from fp4lab.gemm.state import GemmState
from fp4lab.numerics.quantize import dequantize, fake_quant, quantize
from fp4lab.gemm.recipe import RECIPES, OperandQuant, Recipe, get_recipe, recipe_names

__version__ = "0.1.0"

# what a user needs to quantize, run a GEMM under a recipe and govern a model by a policy;
# the rest by module (fp4lab.numerics.formats.ELEMENTS, fp4lab.features.outcontrol.OutControl,
# fp4lab.policy.Depth, fp4lab.numerics.metrics.METRIC_NAMES, fp4lab.numerics.hadamard.rht,
# fp4lab.numerics.backend.KernelFallback, ...)
__all__ = [
    # formats and quantizers
    "FORMATS", "Format", "format_names", "get_format", "QArray", "quantize", "dequantize",
    "fake_quant",
    # numerics
    "quant_metrics", "probe_zeros", "probe_table",
    # GEMMs and recipes
    "qdot_general", "qeinsum", "qragged_dot", "qexpert_einsum", "GemmState", "Recipe",
    "OperandQuant", "RECIPES", "get_recipe", "recipe_names",
    # policies
    "PrecisionPolicy", "Rule", "nemotron3", "explain", "get_policy", "load_policy",
    "save_policy",
]
