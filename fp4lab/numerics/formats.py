"""Number formats as data.

Two layers, both frozen, hashable dataclasses that can be passed to ``jax.jit`` as static
arguments:

* :class:`ElementFormat` describes the bits of one element (E2M1, E4M3, E5M2, E8M0, INT8,
  INT4, and the pass-through BF16/FP16/FP32): its grid, range and how it is stored.
* :class:`Format` combines an element format with a scale scheme (``fp4lab.numerics.scaling``) and a
  scaling granularity (per tensor, per channel, per block of ``block`` elements along an axis).

Adding a format means adding an instance to :data:`FORMATS`; no code elsewhere branches on
format names. Names are parsed once, at the boundary, by :func:`get_format`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
import ml_dtypes

from fp4lab.numerics import scaling

__all__ = [
    "ElementFormat",
    "Format",
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "INT8",
    "INT4",
    "BF16",
    "FP16",
    "FP32",
    "E5M6",
    "ELEMENTS",
    "FORMATS",
    "get_format",
    "format_names",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """One element's number format.

    For floats, ``mantissa_bits`` and ``emin`` (the exponent of the smallest normal) define the
    grid: in the binade ``[2**e, 2**(e+1))`` values are spaced ``2**(e - mantissa_bits)``, and
    below ``2**emin`` the spacing stays ``2**(emin - mantissa_bits)`` (subnormals). For integers
    the grid is the integers in ``[min_value, max]``.
    """

    name: str
    kind: Literal["float", "int"]
    bits: int
    max: float  # largest finite magnitude (for ints: the largest positive value)
    min_value: float  # most negative finite value
    exponent_bits: int = 0
    mantissa_bits: int = 0
    bias: int = 0
    has_inf: bool = False
    has_nan: bool = False
    # How quantized values are stored: a jnp dtype name; 4-bit formats are packed two per uint8.
    storage: str = "uint8"
    packed: bool = False

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (floats)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value, ``floor(log2(max))`` (floats; OCP MX's
        ``emax_elem``: E4M3 8, E5M2 15, E2M1 2)."""
        return math.floor(math.log2(self.max))

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin if self.kind == "float" else 1.0

    @property
    def min_subnormal(self) -> float:
        if self.kind == "int":
            return 1.0
        if self.mantissa_bits == 0:  # E8M0 has no subnormals
            return self.min_normal
        return 2.0 ** (self.emin - self.mantissa_bits)

    @property
    def dtype(self):
        return jnp.dtype(self.storage)

    @property
    def is_storage_dtype(self) -> bool:
        """Whether the format *is* its storage dtype (BF16, FP16, FP32, FP8), so that a
        convert rounds onto its grid; E5M6 is stored in FP16 but has a coarser grid."""
        if self.kind != "float" or self.packed:
            return False
        info = ml_dtypes.finfo(jnp.dtype(self.storage))
        return int(info.nmant) == self.mantissa_bits and int(info.nexp) == self.exponent_bits

    def grid(self) -> list[float]:
        """All non-negative finite values of the format, ascending (small formats only)."""
        if self.kind == "int":
            return [float(i) for i in range(0, int(self.max) + 1)]
        if self.bits > 8:
            raise ValueError(f"grid() enumerates 4- and 8-bit formats only, not {self.name}")
        values = set()
        for code in range(2 ** (self.bits - 1)):
            e_field, m_field = code >> self.mantissa_bits, code & ((1 << self.mantissa_bits) - 1)
            if e_field == 0:
                v = m_field * self.min_subnormal
            else:
                v = (1 + m_field / 2**self.mantissa_bits) * 2.0 ** (e_field - self.bias)
            if v <= self.max:
                values.add(v)
        return sorted(values)


def _float_element(name, e, m, bias, max_value, *, inf, nan, storage, packed=False):
    return ElementFormat(
        name=name, kind="float", bits=1 + e + m, exponent_bits=e, mantissa_bits=m, bias=bias,
        max=max_value, min_value=-max_value, has_inf=inf, has_nan=nan, storage=storage,
        packed=packed,
    )


E2M1 = _float_element("e2m1", 2, 1, 1, 6.0, inf=False, nan=False, storage="uint8", packed=True)
E4M3 = _float_element("e4m3", 4, 3, 7, 448.0, inf=False, nan=True, storage="float8_e4m3fn")
E5M2 = _float_element("e5m2", 5, 2, 15, 57344.0, inf=True, nan=True, storage="float8_e5m2")
# E8M0 is a scale-only format: 2**(byte - 127), byte 0xFF = NaN; stored as its uint8 byte.
E8M0 = ElementFormat(
    name="e8m0", kind="float", bits=8, exponent_bits=8, mantissa_bits=0, bias=127,
    max=2.0**127, min_value=2.0**-127, has_nan=True, storage="uint8",
)
INT8 = ElementFormat(name="int8", kind="int", bits=8, max=127.0, min_value=-128.0, storage="int8")
INT4 = ElementFormat(
    name="int4", kind="int", bits=4, max=7.0, min_value=-8.0, storage="uint8", packed=True
)
BF16 = _float_element("bf16", 8, 7, 127, float(jnp.finfo(jnp.bfloat16).max), inf=True,
                      nan=True, storage="bfloat16")
FP16 = _float_element("fp16", 5, 10, 15, 65504.0, inf=True, nan=True, storage="float16")
# DeepSeek-V3's 12-bit minifloat (the attention output it stores for the backward pass): FP16's
# exponent with 6 mantissa bits, so every value is an FP16 value and FP16 stores it exactly
# (2 bytes an element here; a packed 12-bit layout would take 1.5)
E5M6 = _float_element("e5m6", 5, 6, 15, (2 - 2.0**-6) * 2.0**15, inf=True, nan=True,
                      storage="float16")
FP32 = _float_element("fp32", 8, 23, 127, float(jnp.finfo(jnp.float32).max), inf=True,
                      nan=True, storage="float32")

ELEMENTS: dict[str, ElementFormat] = {
    f.name: f for f in (E2M1, E4M3, E5M2, E8M0, INT8, INT4, BF16, FP16, FP32, E5M6)
}

Granularity = Literal["none", "tensor", "channel", "block"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """A quantization format: element format + scale scheme + granularity.

    granularity:
      * ``"none"``: pass-through cast (BF16/FP16/FP32), no scale.
      * ``"tensor"``: one scale for the whole tensor.
      * ``"channel"``: one scale per slice along the quantization axis (the whole axis is the
        block).
      * ``"block"``: one scale per ``block`` consecutive elements along the axis (or per 2D
        tile, when ``quantize`` is given ``tile=``).
    """

    name: str
    element: ElementFormat
    scaling: scaling.ScaleScheme
    granularity: Granularity
    block: int = 0
    follows: str = ""  # the system / spec whose arithmetic this reproduces

    def __post_init__(self):
        if (self.granularity == "block") != (self.block > 0):
            raise ValueError(f"{self.name}: block={self.block} requires granularity='block'")
        if self.element.packed and self.block % 2:
            raise ValueError(f"{self.name}: packed 4-bit elements need an even block size")

    @property
    def is_passthrough(self) -> bool:
        return self.granularity == "none"

    @property
    def has_global_scale(self) -> bool:
        """True when the format carries a per-tensor scale besides its block scales (NVFP4)."""
        return self.scaling.outer_amax is not None

    def bits_per_element(self, axis_length: int | None = None) -> float:
        """Storage bits per element including block scales (the per-tensor FP32 scale of NVFP4
        and of per-tensor FP8 is amortized to ~0 and not counted). ``channel`` granularity
        needs the channel length; ``nan`` is returned without it."""
        scale_bits = self.scaling.storage.bits
        if self.granularity == "block":
            return self.element.bits + scale_bits / self.block
        if self.granularity == "channel":
            return self.element.bits + (scale_bits / axis_length if axis_length else math.nan)
        return float(self.element.bits)

    def __str__(self) -> str:
        return self.name


def _block(name, element, scheme, block, follows):
    return Format(name=name, element=element, scaling=scheme, granularity="block", block=block,
                  follows=follows)


_MX = "OCP Microscaling v1.0 / torchao to_mx"
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _block("nvfp4", E2M1, scaling.NVFP4Scale(), 16, "NVIDIA Transformer Engine NVFP4"),
        _block("nvfp4_row", E2M1, scaling.RowScaledNVFP4Scale(), 16,
               "Transformer Engine NVFP4 with one amax per row (NVTE_NVFP4_ROW_SCALED_ACTIVATION)"),
        _block("nvfp4_4over6", E2M1, scaling.FourOverSixScale(), 16,
               "Four Over Six (arXiv 2512.02010), Transformer Engine's 4over6 (MAE, E 256)"),
        _block("nvfp4_4over6_mse", E2M1, scaling.FourOverSixScale(error="mse"), 16,
               "Four Over Six, the authors' MSE choice (Transformer Engine arithmetic, E 256)"),
        _block("quest_mxfp4", E2M1, scaling.QuESTScale(), 32,
               "Quartet's forward (QuEST): std-based power-of-two scale per 32, ties toward 0"),
        _block("tseng_mxfp4", E2M1, scaling.TsengScale(), 32,
               "Quartet's backward: 2**(E-2)*4/3 float32 scale per 32 (Tseng et al.'s 3/4)"),
        _block("nvfp4_quartet2", E2M1, scaling.Quartet2Scale(), 16,
               "Quartet II's forward NVFP4 (rtn_1x16s: decode-side scales, ties away)"),
        _block("nvfp4_quartet2_4over6", E2M1, scaling.Quartet2Scale(four_over_six=True), 16,
               "Quartet II's forward NVFP4 with Four Over Six (S 256, squared error)"),
        _block("nvfp4_eden", E2M1, scaling.EdenScale(), 16,
               "Quartet II's backward MS-EDEN: corrected E4M3 scales, SR of the scale"),
        _block("nvfp4_double", E2M1, scaling.DoubleBlockScale(), 16,
               "TetraJet-v2's double-block NVFP4: float32 outer scale per 128, E4M3 per 16"),
        _block("nvfp4_atw", E2M1, scaling.EncodeFactorE4M3Scale(), 16,
               "FP4 All the Way's NVFP4: the encode factor 6/bamax rounded to E4M3"),
        _block("nvfp4_atw_sat", E2M1, scaling.EncodeFactorE4M3Scale(saturating_cast=True), 16,
               "nvfp4_atw with PyTorch 2.13's saturating E4M3 cast (> 464 gives 448, not NaN)"),
        _block("mxfp8", E4M3, scaling.PowerOfTwoScale(mode="rceil"), 32, _MX + " (RCEIL)"),
        _block("mxfp8_e5m2", E5M2, scaling.PowerOfTwoScale(mode="rceil"), 32, _MX + " (RCEIL)"),
        _block("mxfp4", E2M1, scaling.PowerOfTwoScale(mode="rceil"), 32, _MX + " (RCEIL)"),
        _block("mxfp8_floor", E4M3, scaling.PowerOfTwoScale(mode="floor"), 32, _MX + " (FLOOR)"),
        _block("mxfp8_e5m2_floor", E5M2, scaling.PowerOfTwoScale(mode="floor"), 32,
               _MX + " (FLOOR)"),
        _block("mxfp4_floor", E2M1, scaling.PowerOfTwoScale(mode="floor"), 32, _MX + " (FLOOR)"),
        Format(name="fp8_e4m3", element=E4M3, scaling=scaling.AbsMaxScale(), granularity="tensor",
               follows="Transformer Engine FP8 current scaling"),
        Format(name="fp8_e5m2", element=E5M2, scaling=scaling.AbsMaxScale(), granularity="tensor",
               follows="Transformer Engine FP8 current scaling"),
        _block("fp8_block128", E4M3, scaling.AbsMaxScale(), 128,
               "DeepSeek-V3 fine-grained FP8 (1x128; tile=(128, 128) for weights)"),
        Format(name="int8", element=INT8, scaling=scaling.AbsMaxScale(), granularity="channel",
               follows="symmetric per-channel INT8"),
        Format(name="fp8_e4m3_row", element=E4M3, scaling=scaling.AbsMaxScale(),
               granularity="channel",
               follows="E4M3 with one float32 abs-max scale per row along the axis (per token)"),
        _block("fp8_block128_pow2", E4M3, scaling.PowerOfTwoScale(mode="rceil"), 128,
               "DeepSeek-V3 activation caching: E4M3 1x128 with power-of-two scales"),
        _block("e5m6_block128", E5M6, scaling.AbsMaxScale(), 128,
               "DeepSeek-V3's E5M6 for the attention output, 1x128 with float32 abs-max scales "
               "(the paper gives the element format; the scaling here is fp8_block128's)"),
        _block("e5m6_block128_pow2", E5M6, scaling.CeilPowerOfTwoScale(), 128,
               "DeepSeek-V3's E5M6 attention output, 1x128 with power-of-two scales ('round "
               "scaled, i.e. integral power of 2'): 2**ceil(log2(amax / max)), E8M0 bytes"),
        _block("int8_block128", INT8, scaling.AbsMaxScale(), 128,
               "symmetric INT8, one float32 scale per 128 (Nemotron 3 Ultra's SSM-state cache)"),
        Format(name="int4", element=INT4, scaling=scaling.AbsMaxScale(), granularity="channel",
               follows="symmetric per-channel INT4"),
        _block("int4_q4_0", INT4, scaling.GGMLQ4_0Scale(), 32, "GGML Q4_0 arithmetic"),
        _block("int8_q8_0", INT8, scaling.GGMLQ8_0Scale(), 32, "GGML Q8_0 arithmetic"),
        Format(name="bf16", element=BF16, scaling=scaling.NoScale(), granularity="none"),
        Format(name="fp16", element=FP16, scaling=scaling.NoScale(), granularity="none"),
        Format(name="fp32", element=FP32, scaling=scaling.NoScale(), granularity="none"),
    )
}
_ALIASES = {"mxfp8_e4m3": "mxfp8", "mxfp8_e4m3_floor": "mxfp8_floor"}


def format_names() -> list[str]:
    return list(FORMATS) + list(_ALIASES)


def get_format(fmt: str | Format) -> Format:
    """Return the :class:`Format` for a registry name (or the Format itself)."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        key = fmt.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"unknown format {fmt!r}; known formats: {', '.join(format_names())}")
