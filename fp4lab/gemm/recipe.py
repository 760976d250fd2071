"""Recipes: how each operand of each of a linear layer's three GEMMs is quantized.

For ``Y = X W`` (X: tokens x K, W: K x N) a training step runs three GEMMs:

* fprop ``Y = X W``: X and W quantized along K;
* dgrad ``dX = dY W^T``: dY and W quantized along N;
* wgrad ``dW = X^T dY``: X and dY quantized along the token axis M.

A :class:`Recipe` names an :class:`OperandQuant` for each of the six operands. Each operand is
quantized from its high-precision value (never re-quantized); a weight quantized with a 2D tile
in fprop and with the same spec in dgrad is the same quantized weight (its transpose is exact).
QAT recipes (``backward="ste"``) quantize only the forward operands and differentiate straight
through them: dgrad uses the quantized W, wgrad the quantized X, gradients stay in high
precision. A recipe with ``delayed=DelayedScaling(...)`` scales its per-tensor operands from
an amax history instead of their current amax (TE's classic FP8 recipe;
``fp4lab.features.delayed``).

Recipes are frozen dataclasses (jit-static); :data:`RECIPES` holds the named ones.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from fp4lab.features.delayed import DelayedScaling
from fp4lab.numerics.formats import Format, get_format
from fp4lab.gemm.operands import OPERAND_TABLE, OPERANDS, Operand
from fp4lab.features.outcontrol import OutControl

__all__ = ["Operand", "OPERAND_TABLE", "OPERANDS", "OperandQuant", "Recipe",
           "SavedX", "RECIPES", "get_recipe", "recipe_names"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandQuant:
    """How one GEMM operand is quantized.

    Attributes:
      format: format name or :class:`~fp4lab.numerics.formats.Format` (``"bf16"``: a plain cast).
      tile: 2D tile for weights, e.g. ``(16, 16)``; then the operand is quantized once and
        serves every GEMM that uses the same spec.
      rounding: ``"nearest"`` or ``"stochastic"`` (needs a key at call time).
      hadamard: random Hadamard transform group size along the quantization axis, 0 for
        none. On the forward operands both must use the same transform (it cancels in the
        product); the forward's output is then computed, and saved, in the rotated domain.
      hadamard_signs: the sign vector of this operand's transform (``"te"``, ``"none"``, an
        int seed); ``None``: the recipe's ``hadamard_signs``.
      source: ``"input"`` (quantize the high-precision tensor) or, for ``dgrad_w`` and
        ``wgrad_x``, ``"forward"``: quantize the forward GEMM's quantized W or X again (as
        Quartet, Quartet II and TetraJet-v2 do: the backward never sees the master copy).
    """

    format: str | Format = "bf16"
    tile: tuple[int, int] | None = None
    rounding: Literal["nearest", "stochastic"] = "nearest"
    hadamard: int = 0
    hadamard_signs: str | int | None = None
    source: Literal["input", "forward"] = "input"

    def __post_init__(self):
        object.__setattr__(self, "format", get_format(self.format))
        if self.tile is not None:
            object.__setattr__(self, "tile", tuple(self.tile))
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding={self.rounding!r} is not 'nearest' or 'stochastic'")
        if self.hadamard < 0 or (self.hadamard & (self.hadamard - 1)):
            raise ValueError(f"hadamard={self.hadamard} must be 0 or a power of two")
        if self.source not in ("input", "forward"):
            raise ValueError(f"source={self.source!r} is not 'input' or 'forward'")

    @property
    def is_identity(self) -> bool:
        return self.format.is_passthrough and self.hadamard == 0

    def describe(self) -> str:
        s = self.format.name
        if self.tile:
            s += f" {self.tile[0]}x{self.tile[1]}"
        if self.rounding == "stochastic":
            s += " SR"
        if self.hadamard:
            s += (f" H{self.hadamard}" if self.hadamard_signs == "none"
                  else f" RHT{self.hadamard}")
        if self.source == "forward":
            s += " of fwd"
        return s


def _op(fmt="bf16", **kw) -> OperandQuant:
    return OperandQuant(format=fmt, **kw)


@dataclasses.dataclass(frozen=True)
class SavedX:
    """What a GEMM stores of its input X for the backward pass (the wgrad GEMM's X and the
    probes then use ``dequantize(quantize(X))``): ``format`` quantizes X in blocks along K
    (``fp8_block128``: Kimi K2's E4M3 1x128 tiles with float32 scales;
    ``fp8_block128_pow2``: the same with power-of-two scales, DeepSeek-V3's;
    ``e5m6_block128_pow2``: DeepSeek-V3's attention output; ``mxfp8``;
    ``bf16``: a cast), and ``offload`` keeps it in host memory (``jax.memory.Space.Host``)
    between the forward and the backward pass. Compute is unchanged."""

    format: str | Format = "fp8_block128"
    offload: bool = False

    def __post_init__(self):
        object.__setattr__(self, "format", get_format(self.format))

    def refusal(self, recipe: Recipe) -> str | None:
        """Why ``recipe`` cannot store X this way, or None: the backward must read X."""
        if recipe.requantizes or recipe.trust:
            return ("saved_x stores the input X, which a backward that requantizes the "
                    "forward's operands or applies the trust mask does not read")
        return None

    def describe(self) -> str:
        return f"saved x: {self.format.name}" + (" (host)" if self.offload else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Quantization of the six GEMM operands of a linear layer (see module docstring).

    ``hadamard_signs`` selects the RHT sign vector: ``"te"`` (Transformer Engine's fixed
    16-entry vector), an int seed for a fixed random one shared by all layers, or
    ``"random"``: one drawn from the GEMM's key at every call, per GEMM (shared by its two
    operands), as Quartet, Quartet II and TetraJet-v2 redraw theirs.
    ``delayed``: scale the per-tensor operands from an amax history
    (:mod:`fp4lab.features.delayed`); the GEMM's state then needs its ``amax_history``.
    ``outliers``: TetraJet-v2's OutControl (:class:`OutControl`); the GEMM splits K once its
    state has ``channels``.
    ``expert_scale``: in a grouped GEMM (:func:`fp4lab.qragged_dot`), whether each expert's
    operands take their own per-tensor amax (``"expert"``: NVFP4's FP32 global scale, FP8
    current scaling; TE's ``GroupedLinear``) or one amax over the whole stack's
    (``"shared"``, as vLLM's FP8 MoE loads one input scale for all experts); a dense GEMM
    is one tensor either way.
    """

    name: str
    fprop_x: OperandQuant = _op()
    fprop_w: OperandQuant = _op()
    dgrad_dy: OperandQuant = _op()
    dgrad_w: OperandQuant = _op()
    wgrad_x: OperandQuant = _op()
    wgrad_dy: OperandQuant = _op()
    backward: Literal["quantized", "ste"] = "quantized"
    hadamard_signs: str | int = "te"
    delayed: DelayedScaling | None = None
    saved_x: SavedX | None = None  # None: the GEMM saves X as it came (today's)
    trust: bool = False
    outliers: OutControl | None = None
    expert_scale: Literal["expert", "shared"] = "expert"
    follows: str = ""

    def __post_init__(self):
        if self.backward not in ("quantized", "ste"):
            raise ValueError(f"backward={self.backward!r} is not 'quantized' or 'ste'")
        if self.expert_scale not in ("expert", "shared"):
            raise ValueError(f"recipe {self.name}: expert_scale={self.expert_scale!r} is not "
                             "'expert' or 'shared'")
        if self.expert_scale == "shared" and self.delayed is not None:
            raise ValueError(f"recipe {self.name}: expert_scale='shared' with delayed scaling "
                             "(an amax history scales each expert from its own history)")
        for o in OPERAND_TABLE:
            if getattr(self, o.name).source == "forward" and o.name not in (
                    "dgrad_w", "wgrad_x"):
                raise ValueError(f"recipe {self.name}: {o.name} has source='forward'; only "
                                 "dgrad_w and wgrad_x can requantize the forward's operand")
        for o in OPERAND_TABLE:
            op = getattr(self, o.name)
            if op.hadamard and op.hadamard != 16 and self.signs(op) == "te":
                raise ValueError(f"recipe {self.name}: {o.name} has hadamard={op.hadamard} "
                                 "with TE's sign vector, which has 16 entries; use "
                                 "hadamard_signs='none', 'random' or an int seed")
        for gemm, (a, b) in (("fprop", ("fprop_x", "fprop_w")), ("dgrad", ("dgrad_dy", "dgrad_w")),
                             ("wgrad", ("wgrad_x", "wgrad_dy"))):
            oa, ob = getattr(self, a), getattr(self, b)
            if (oa.hadamard, self.signs(oa)) != (ob.hadamard, self.signs(ob)):
                raise ValueError(
                    f"recipe {self.name}: {a} and {b} must use the same transform (got "
                    f"hadamard {oa.hadamard}/{ob.hadamard}, signs {self.signs(oa)!r}/"
                    f"{self.signs(ob)!r}): it has to cancel in the {gemm} GEMM")
        if self.fprop_x.hadamard and self.fprop_w.tile:
            raise ValueError(f"recipe {self.name}: a forward Hadamard transform runs along K, "
                             f"a 2D weight tile (tile={self.fprop_w.tile}) cannot follow it")
        if self.backward == "ste" and (self.requantizes or self.trust or self.saved_x):
            raise ValueError(f"recipe {self.name}: a QAT backward (backward='ste') has no "
                             "backward GEMMs, so nothing to requantize, mask or save: "
                             "saved_x, source='forward' and the trust mask need "
                             "backward='quantized'")
        for feature in self.features:
            reason = feature.refusal(self)
            if reason:
                raise ValueError(f"recipe {self.name}: {reason}")

    @property
    def features(self) -> tuple:
        """The recipe's features beyond its operand formats (delayed scaling, saved X,
        OutControl): each says by its ``refusal(recipe)`` what it cannot be combined with."""
        return tuple(f for f in (self.delayed, self.saved_x, self.outliers) if f is not None)

    def signs(self, op: OperandQuant) -> str | int:
        """The sign vector of ``op``'s Hadamard transform (its own, else the recipe's)."""
        return self.hadamard_signs if op.hadamard_signs is None else op.hadamard_signs

    @property
    def requantizes(self) -> bool:
        """True when a backward operand is quantized from the forward's quantized tensor."""
        return self.dgrad_w.source == "forward" or self.wgrad_x.source == "forward"

    @property
    def delayed_operands(self) -> tuple[str, ...]:
        """The operands scaled from the amax history (per-tensor formats, when ``delayed``)."""
        if self.delayed is None:
            return ()
        return tuple(k for k, v in self.quantized_operands.items()
                     if v.format.granularity == "tensor")

    @property
    def operands(self) -> dict[str, OperandQuant]:
        return {name: getattr(self, name) for name in OPERANDS}

    @property
    def quantized_operands(self) -> dict[str, OperandQuant]:
        """The operands this recipe's GEMMs quantize: all six, or (QAT, ``backward="ste"``)
        the forward GEMM's two."""
        return {o.name: getattr(self, o.name) for o in OPERAND_TABLE
                if self.backward == "quantized" or o.gemm == "fprop"}

    @property
    def needs_key(self) -> bool:
        return any(o.rounding == "stochastic" or (o.hadamard and self.signs(o) == "random")
                   for o in self.quantized_operands.values())

    @property
    def is_identity(self) -> bool:
        return self.saved_x is None and all(o.is_identity for o in self.operands.values())

    def describe(self) -> str:
        ops = self.operands
        if self.backward == "ste":
            return (f"QAT fwd x:{ops['fprop_x'].describe()} w:{ops['fprop_w'].describe()}, "
                    "straight-through bwd")
        return "; ".join([", ".join(f"{k}:{v.describe()}" for k, v in ops.items())]
                         + self.notes())

    def notes(self) -> list[str]:
        """What the recipe does beyond quantizing each operand, one phrase per feature (the
        one describer: :meth:`describe` and ``explain``'s table both print these)."""
        notes = []
        if self.delayed:
            d = self.delayed
            notes.append(f"delayed scaling (history {d.history_len}, {d.amax_compute_algo}, "
                         f"margin {d.margin})")
        if self.saved_x:
            notes.append(self.saved_x.describe())
        if self.trust:
            notes.append("trust mask (gradient only where the forward did not clip)")
        if "random" in (self.signs(o) for o in self.operands.values()):
            notes.append("sign vectors redrawn every call")
        if self.outliers:
            notes.append(self.outliers.describe())
        return notes


def _uniform(name, fmt, follows, **kw) -> Recipe:
    op = _op(fmt)
    return Recipe(name=name, fprop_x=op, fprop_w=op, dgrad_dy=op, dgrad_w=op, wgrad_x=op,
                  wgrad_dy=op, follows=follows, **kw)


def _nvfp4(name, *, rht=16, sr=True, weight_tile=(16, 16), follows="", **kw):
    sr_ = "stochastic" if sr else "nearest"
    w = _op("nvfp4", tile=weight_tile)
    return Recipe(
        name=name,
        fprop_x=_op("nvfp4"), fprop_w=w,
        dgrad_dy=_op("nvfp4", rounding=sr_), dgrad_w=w,
        wgrad_x=_op("nvfp4", hadamard=rht), wgrad_dy=_op("nvfp4", rounding=sr_, hadamard=rht),
        follows=follows, **kw,
    )


def _four_over_six(name, fmt, *, follows):
    w = _op(fmt, tile=(16, 16))
    dy = _op("nvfp4", rounding="stochastic")
    return Recipe(name=name, fprop_x=_op(fmt), fprop_w=w, dgrad_dy=dy, dgrad_w=w,
                  wgrad_x=_op(fmt), wgrad_dy=dy, follows=follows)


def _requantizing(name, fwd: OperandQuant, bwd: OperandQuant, *, follows, **kw) -> Recipe:
    """The published recipes' shape: X and W quantized alike in the forward, the four backward
    operands alike, W and X requantized from the forward's, signs redrawn every call."""
    again = dataclasses.replace(bwd, source="forward")
    return Recipe(name=name, fprop_x=fwd, fprop_w=fwd, dgrad_dy=bwd, dgrad_w=again,
                  wgrad_x=again, wgrad_dy=bwd, hadamard_signs="random", follows=follows, **kw)


def _qat(name, w, x="bf16", w_tile=None, follows=""):
    return Recipe(name=name, fprop_x=_op(x), fprop_w=_op(w, tile=w_tile), backward="ste",
                  follows=follows)


_NVFP4_PAPER = "NVIDIA, 'Pretraining LLMs with NVFP4' (2025) / Nemotron 3"
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _uniform("bf16", "bf16", "BF16 operands, FP32 accumulation (must equal a plain BF16 dot)"),
    _uniform("fp32", "fp32", "FP32 operands"),
    _uniform("fp16", "fp16", "FP16 operands, FP32 accumulation (FP16 serving, as in "
             "'Defeating the training-inference mismatch via FP16')"),
    Recipe(
        name="fp8_hybrid",
        fprop_x=_op("fp8_e4m3"), fprop_w=_op("fp8_e4m3"),
        dgrad_dy=_op("fp8_e5m2"), dgrad_w=_op("fp8_e4m3"),
        wgrad_x=_op("fp8_e4m3"), wgrad_dy=_op("fp8_e5m2"),
        follows="TE 'HYBRID' FP8 with per-tensor current scaling (Float8CurrentScaling; "
                "fp8_delayed is the same with TE's delayed scaling)",
    ),
    Recipe(
        name="fp8_delayed",
        fprop_x=_op("fp8_e4m3"), fprop_w=_op("fp8_e4m3"),
        dgrad_dy=_op("fp8_e5m2"), dgrad_w=_op("fp8_e4m3"),
        wgrad_x=_op("fp8_e4m3"), wgrad_dy=_op("fp8_e5m2"),
        delayed=DelayedScaling(),
        follows="TE's classic FP8 recipe: 'HYBRID' formats, per-tensor scales from a "
                "1024-step amax history (DelayedScaling: amax_compute_algo='max', margin 0)",
    ),
    Recipe(
        name="fp8_blockwise",
        fprop_x=_op("fp8_block128"), fprop_w=_op("fp8_block128", tile=(128, 128)),
        dgrad_dy=_op("fp8_block128"), dgrad_w=_op("fp8_block128", tile=(128, 128)),
        wgrad_x=_op("fp8_block128"), wgrad_dy=_op("fp8_block128"),
        follows="DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight blocks, E4M3 "
                "everywhere, float32 scales (DeepSeek rounds scales to powers of two in "
                "later releases; here they are plain float32)",
    ),
    _uniform("mxfp8", "mxfp8", "MXFP8 pre-training recipe: E4M3 everywhere, RCEIL scales"),
    _uniform("mxfp8_floor", "mxfp8_floor", "MXFP8 with OCP FLOOR scales (torchao's to_mx "
             "default, torchtitan's mxfp8_cublas before 2026-03), which arXiv 2506.08027 saw "
             "diverge at 8B / 15T tokens where RCEIL (mxfp8) matched BF16"),
    Recipe(
        name="nvfp4_row_scaled",
        fprop_x=_op("nvfp4_row"), fprop_w=_op("nvfp4"), dgrad_dy=_op("nvfp4"),
        dgrad_w=_op("nvfp4"), wgrad_x=_op("nvfp4_row"), wgrad_dy=_op("nvfp4"),
        follows="Transformer Engine's row-scaled NVFP4 activations as its tests run them: one "
                "amax per token for X (per feature for its wgrad copy), weights and gradients "
                "per tensor; 1D weight blocks, no RHT, no SR (TE's canonical config)"),
    _four_over_six("nvfp4_4over6", "nvfp4_4over6",
                   follows="Four Over Six (arXiv 2512.02010) as Transformer Engine trains it "
                   "(NVTE_NVFP4_4OVER6=all, MAE): 4/6 block scales with E 256 on X and W, "
                   "1D X, 16x16 W, no RHT; gradients plain NVFP4 with SR"),
    _four_over_six("nvfp4_4over6_mse", "nvfp4_4over6_mse",
                   follows="nvfp4_4over6 with the authors' MSE choice of map-to-4"),
    Recipe(
        name="mxfp4",
        fprop_x=_op("mxfp4"), fprop_w=_op("mxfp4"),
        dgrad_dy=_op("mxfp4", rounding="stochastic"), dgrad_w=_op("mxfp4"),
        wgrad_x=_op("mxfp4", hadamard=16),
        wgrad_dy=_op("mxfp4", rounding="stochastic", hadamard=16),
        follows="'Training LLMs with MXFP4' (Tseng et al. 2025): RHT and SR in the backward "
                "pass (the paper uses RHT groups up to 256 and BF16 forward in places)",
    ),
    _requantizing(
        "quartet", _op("quest_mxfp4", hadamard=32, hadamard_signs="none"),
        _op("tseng_mxfp4", rounding="stochastic", hadamard=32), trust=True,
        follows="Quartet (arXiv 2505.14669; IST-DASLab/Quartet 00ccd38): QuEST MXFP4 after a "
                "fixed H32 forward with the trust mask, Tseng SR MXFP4 after H32 with random "
                "signs (redrawn every call) on all four backward operands, W and X "
                "requantized from the forward's"),
    _requantizing(
        "quartet_ii", _op("nvfp4_quartet2_4over6"),
        _op("nvfp4_eden", rounding="stochastic", hadamard=128),
        follows="Quartet II (arXiv 2601.22813; IST-DASLab/Quartet-II 8776a90, the Triton "
                "scheme): NVFP4 1x16 forward with Four Over Six, MS-EDEN after RHT128 on all "
                "four backward operands, W and X requantized from the forward's"),
    _requantizing(
        "tetrajet_v2", _op("nvfp4_double"),
        _op("nvfp4_double", rounding="stochastic", hadamard=16),
        follows="TetraJet-v2 (arXiv 2510.27527; thu-ml/TetraJet-v2-NVFP4Training ca5953f): "
                "double-block NVFP4 (outer float32 scale per 128), RTN forward, RHT16 and "
                "dithered SR on the four backward operands, W and X requantized from the "
                "forward's; OsciReset is train.osci_reset (fp4lab.features.osci_reset); "
                "tetrajet_v2_outcontrol adds OutControl"),
    _requantizing(
        "tetrajet_v2_outcontrol", _op("nvfp4_double"),
        _op("nvfp4_double", rounding="stochastic", hadamard=16), outliers=OutControl(),
        follows="TetraJet-v2's 'mix_fp8' configs (thu-ml/TetraJet-v2-NVFP4Training ca5953f, "
                "linear_mix.py): tetrajet_v2 with OutControl, the 10 % input channels of "
                "largest accumulated L2 norm in MXFP8 (RCEIL, RTN) in fprop and wgrad, once "
                "chosen (experiments: train.outcontrol; fp4lab.features.outcontrol)"),
    Recipe(
        name="fp4_all_the_way",
        fprop_x=_op("nvfp4_atw"), fprop_w=_op("nvfp4_atw"),
        dgrad_dy=_op("nvfp4_atw", rounding="stochastic"), dgrad_w=_op("nvfp4_atw"),
        wgrad_x=_op("nvfp4_atw", rounding="stochastic"),
        wgrad_dy=_op("nvfp4_atw", rounding="stochastic"),
        follows="FP4 All the Way (arXiv 2505.19115): its NVFP4 quantizer (E4M3 encode "
                "factors, FP8 max 448), round-to-nearest forward, SR in the backward (dgrad's "
                "dY) and update (wgrad) GEMMs, blocks along each GEMM's reduction axis"),
    _nvfp4("nvfp4", follows=_NVFP4_PAPER + ": 1D 16-blocks for X and dY, 16x16 2D weights, "
           "RHT16 on wgrad inputs, SR on gradients"),
    _nvfp4("nvfp4_no_rht", rht=0, follows="nvfp4 ablation: no random Hadamard transform"),
    _nvfp4("nvfp4_no_sr", sr=False, follows="nvfp4 ablation: round-to-nearest gradients"),
    _nvfp4("nvfp4_shared_scale", expert_scale="shared",
           follows="nvfp4 with one FP32 global scale per operand for a whole expert stack "
           "(the amax over all its experts), where nvfp4 gives each expert its own"),
    _nvfp4("nvfp4_1d_weights", weight_tile=None,
           follows="nvfp4 ablation: 1D weight blocks (W quantized separately along K and N)"),
    _qat("fp4_qat", "mxfp4", follows="FP4 (E2M1) weight QAT as DeepSeek-V4 / MiMo; the "
         "scale here is MX E8M0 per 32 (the systems' exact scale layout is not public)"),
    _qat("mxfp4_w_mxfp8_a_qat", "mxfp4", x="mxfp8",
         follows="Kimi K3-style QAT: MXFP4 weights, MXFP8 activations"),
    _qat("int4_qat", "int4", follows="GLM-style INT4 weight QAT (symmetric per-channel)"),
    _qat("q4_0_qat", "int4_q4_0", follows="Gemma QAT for GGML Q4_0 checkpoints"),
    _qat("q8_0_qat", "int8_q8_0", follows="GGML Q8_0 weight QAT (Q8_0 GGUF checkpoints)"),
    _qat("mxfp4_weights", "mxfp4",
         follows="gpt-oss style weight-only MXFP4 (forward weights only)"),
    _uniform("bf16_saved_fp8", "bf16", "Kimi K2: BF16 compute, the input saved for the "
             "backward pass as E4M3 in 1x128 tiles with float32 scales",
             saved_x=SavedX("fp8_block128")),
    _uniform("bf16_saved_e5m6", "bf16", "DeepSeek-V3's attention output: BF16 compute, the "
             "input saved for the backward pass as E5M6 1x128", saved_x=SavedX("e5m6_block128")),
    _uniform("bf16_saved_e5m6_pow2", "bf16", "DeepSeek-V3's attention output: BF16 compute, "
             "the input saved for the backward pass as E5M6 1x128 with power-of-two scales",
             saved_x=SavedX("e5m6_block128_pow2")),
)}


def recipe_names() -> list[str]:
    return list(RECIPES)


def get_recipe(recipe: str | Recipe) -> Recipe:
    """The :class:`Recipe` for a registry name (or the Recipe itself)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str) and recipe.strip().lower() in RECIPES:
        return RECIPES[recipe.strip().lower()]
    raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(RECIPES)}")
