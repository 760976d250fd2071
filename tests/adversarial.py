"""Adversarial inputs for the quantizers: values on, and one ulp either side of, every rounding
boundary *after each intermediate product* of a format's arithmetic (docs/numerics.md).

A rewrite that XLA may apply to float arithmetic (contracting ``a * b + c`` into an FMA,
replacing a division by a reciprocal product, folding and reassociating constants) changes a
product or a quotient by about one rounding. That moves a code only where the value sits on a
boundary of the next rounding, so each generator solves backwards: for every boundary ``t``
of the rounding that consumes ``v = fl(x * m)`` it places ``x = fl(t / m)`` and its float32
neighbours, whose exact products land on both sides of ``t``; and it chooses the block
statistics so that the scale computations land on their own boundaries (the E4M3 midpoints of
an NVFP4 block scale, the powers of two of an MX exponent, the amaxes whose division by a
constant rounds differently from the reciprocal product).

Only NumPy float32 arithmetic (IEEE) and the oracle's element tables are used; nothing here
imports fp4lab. Every generator is deterministic (seeded) and returns :class:`Case` objects:
2D float32 arrays with blocks along the last axis (or 2D tiles), plus the arguments to quantize
them with.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from oracles import numpy_ref as ref

F32 = np.float32
INF = F32(np.inf)
FLT_MAX = np.finfo(F32).max


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    x: np.ndarray  # float32, 2D
    tile: tuple[int, int] | None = None
    global_amax: float | None = None  # passed to quantize (the oracle gets it too)


# ----------------------------------------------------------------------------- building blocks


def neighbours(v, k: int = 2) -> np.ndarray:
    """``v`` and its ``k`` float32 neighbours on either side (flattened)."""
    v = np.asarray(v, F32).ravel()
    out, up, down = [v], v, v
    for _ in range(k):
        up, down = np.nextafter(up, INF), np.nextafter(down, -INF)
        out += [up, down]
    return np.concatenate(out)


def preimages(targets, mult, k: int = 2) -> np.ndarray:
    """float32 ``x`` whose products ``fl(x * mult)`` fall on and beside each target: the
    quotient ``fl(t / mult)`` and its ``k`` neighbours on either side."""
    with np.errstate(all="ignore"):
        x0 = np.asarray(targets, F32) / F32(mult)
    x = neighbours(x0, k)
    return x[np.isfinite(x) & (np.abs(x) >= np.finfo(F32).tiny)]


def _signed(v) -> np.ndarray:
    v = np.asarray(v, F32)
    return np.concatenate([v, -v])


def element_targets(elem: str) -> np.ndarray:
    """The boundaries of an element rounding (midpoints, the grid values themselves, and
    values past the saturation point), both signs."""
    if elem in ("int8", "int4"):
        qmax = {"int8": 127, "int4": 7}[elem]
        grid = np.arange(0, qmax + 1, dtype=np.float64)
    else:
        n = {"e2m1": 8, "e4m3": 0x7F, "e5m2": 0x7C}[elem]  # the positive finite codes
        grid = np.unique(ref.elem_decode(np.arange(n, dtype=np.uint8), elem).astype(np.float64))
    mids = (grid[:-1] + grid[1:]) / 2
    top = grid[-1]
    return _signed(np.concatenate([grid[1:], mids, [top * 1.03125, top * 1.5]]))


def q4_0_targets() -> np.ndarray:
    """Boundaries of GGML Q4_0's ``floor(fl(v + 8.5))``: ``n - 8.5`` (where the sum is an
    integer) and the least float32 ``v`` whose rounded sum still reaches ``n``, n = 1..15."""
    out = []
    for n in range(1, 16):
        v = F32(n - 8.5)
        out.append(v)
        while F32(np.nextafter(v, -INF) + F32(8.5)) >= n:
            v = np.nextafter(v, -INF)
        out.append(v)
    return np.array(out + [-8.0, 8.0, 7.49], F32)


def rows(first, pool, width: int, n_rows: int, rng) -> np.ndarray:
    """``n_rows`` rows of ``width``: ``first`` (the block statistic) in column 0, the rest
    drawn from ``pool`` without repeats where the pool allows (zeros if it runs dry)."""
    need = n_rows * (width - 1)
    pick = rng.permutation(len(pool))[:need] if len(pool) else np.zeros(0, int)
    fill = np.zeros(need, F32)
    fill[: len(pick)] = pool[pick]
    out = np.concatenate([np.full((n_rows, 1), first, F32),
                          fill.reshape(n_rows, width - 1)], axis=1)
    return out


def _random_magnitudes(rng, n, lo=-12, hi=12) -> np.ndarray:
    mant = 1 + rng.integers(0, 2**23, n) / 2**23
    return (mant * np.exp2(rng.integers(lo, hi, n))).astype(F32)


def _pad_rows(x: np.ndarray, multiple: int = 256) -> np.ndarray:
    """Zero rows up to a multiple (a few shapes, so a few compilations)."""
    pad = -x.shape[0] % multiple
    return np.concatenate([x, np.zeros((pad, x.shape[1]), F32)]) if pad else x


def _e4m3(v) -> np.ndarray:
    return ref.e4m3_value(ref.e4m3_byte(np.minimum(v, F32(448))))


# ----------------------------------------------------------------------------- per scheme


def nvfp4(tile: bool = False, seed: int = 0) -> list[Case]:
    """NVFP4 (TE order): block amaxes on and beside the preimages of every E4M3 value and
    midpoint under ``fl(S_enc * fl(1/6))``; elements on and beside the preimages of every
    E2M1 boundary under the block's ``enc_b``. Tensor amaxes chosen so that S_enc, S_dec are
    inexact (and one where S_enc = 1)."""
    rng = np.random.default_rng(seed)
    e4m3 = ref.e4m3_value(np.arange(1, 0x7F, dtype=np.uint8)).astype(np.float64)
    scale_targets = np.concatenate([e4m3, (e4m3[:-1] + e4m3[1:]) / 2]).astype(F32)
    elem = element_targets("e2m1")
    cases = []
    for amax in (F32(3.0625), F32(2688), F32(0.0123456), F32(777.77)):
        s_enc = np.minimum(F32(2688) / amax, FLT_MAX)
        s_dec = F32(1) / s_enc
        c = s_enc * (F32(1) / F32(6))
        bamaxes = preimages(scale_targets, c, k=1)
        bamaxes = bamaxes[(bamaxes > 0) & (bamaxes <= amax)]
        blocks = []
        for b in bamaxes:
            enc = np.minimum(F32(1) / (_e4m3(np.minimum(b * c, FLT_MAX)) * s_dec), FLT_MAX)
            pool = preimages(elem, enc)
            pool = pool[np.abs(pool) <= b]
            if tile:
                blocks.append(rows(b, pool, 256, 1, rng).reshape(16, 16))
            else:
                blocks.append(rows(b, pool, 16, 2, rng))
        head = np.zeros((16, 16) if tile else (1, 16), F32)
        head.flat[0] = amax  # the tensor amax itself
        if tile:
            x = np.concatenate([head] + blocks, axis=1)
        else:
            x = _pad_rows(np.concatenate([head] + blocks))
        cases.append(Case(f"nvfp4{'-16x16' if tile else ''} amax={amax}", x,
                          (16, 16) if tile else None))
    return cases


def four_over_six(tile: bool = False, seed: int = 0) -> list[Case]:
    """NVFP4 with 4/6 block scales (TE's 4over6, E = 256): block amaxes on and beside the
    preimages of every E4M3 value and midpoint under ``fl(fl(b / 6) * S_enc)`` for map-to-6
    and under its 1.5x for map-to-4, elements on and beside the E2M1 boundaries of both
    candidates' ``enc``; blocks whose two errors tie (a constant block: both exact) and the
    worked examples of the 4/6 spec (MAE and MSE choosing differently)."""
    rng = np.random.default_rng(seed)
    e4m3 = ref.e4m3_value(np.arange(1, 0x7F, dtype=np.uint8)).astype(np.float64)
    scale_targets = np.concatenate([e4m3, (e4m3[:-1] + e4m3[1:]) / 2]).astype(F32)
    elem = element_targets("e2m1")
    width = 256 if tile else 16
    cases = []
    for amax in (F32(3.0625), F32(1536), F32(0.0123456), F32(777.77)):
        s_enc = np.minimum(F32(1536) / amax, FLT_MAX)
        s_dec = F32(1) / s_enc
        bamaxes = np.concatenate([preimages(scale_targets, s_enc / F32(6), k=1),
                                  preimages(scale_targets / F32(1.5), s_enc / F32(6), k=1)])
        bamaxes = rng.permutation(bamaxes[(bamaxes > 0) & (bamaxes <= amax)])[:160]
        blocks = []
        for b in bamaxes:
            base = (b / F32(6)) * s_enc
            encs = [np.minimum(F32(1) / (_e4m3(m) * s_dec), FLT_MAX)
                    for m in (base, base * F32(1.5))]
            pool = np.concatenate([preimages(elem, e) for e in encs])
            pool = pool[np.abs(pool) <= b]
            blocks.append(rows(b, pool, width, 1, rng).reshape((16, 16) if tile else (1, 16)))
        head = np.zeros((16, 16) if tile else (1, 16), F32)
        head.flat[0] = amax  # the tensor amax itself
        ties = np.full((16, 16) if tile else (1, 16), amax / F32(3), F32)
        x = np.concatenate([head, ties] + blocks, axis=1 if tile else 0)
        cases.append(Case(f"4over6{'-16x16' if tile else ''} amax={amax}",
                          x if tile else _pad_rows(x), (16, 16) if tile else None))
    worked = np.zeros((4, 16), F32)  # the spec's examples: 4/6 over 6, MAE vs MSE, map-to-4
    worked[0, :4] = 5, 4.2, 3.3, 1
    worked[1] = [6, 5, 4.5, -4, 3, 2, 1, 0.5] + [0.25] * 8
    worked[2] = [6] + [5] * 15
    worked[3] = 1.0
    cases.append(Case("4over6 worked examples", _pad_rows(worked)))
    return cases


def mx(elem: str, seed: int = 0) -> list[Case]:
    """MX (RCEIL and FLOOR alike): block amaxes on and beside ``2**k`` (FLOOR's exponent
    boundaries) and beside the preimages of ``2**k`` under ``fl(1/max)`` (RCEIL's), elements
    on and beside every element boundary times the block's power-of-two scale."""
    rng = np.random.default_rng(seed)
    emax = ref.ELEM_MAX[elem]
    inv_max = F32(1) / emax
    powers = np.exp2(np.array([-20, -3, -1, 0, 1, 5, 17], np.float64)).astype(F32)
    # blocks whose exponent clamps at E8M0's -127 (RCEIL, FLOOR): dequantizing multiplies by
    # 2**-63 and 2**-64 there, and a product of the two constants would be subnormal
    emax_exp = ref.MX_EMAX[elem]
    powers = np.concatenate([powers, np.asarray([emax * F32(2.0**-127),
                                                 np.exp2(emax_exp - 127.0)], F32)])
    bamaxes = np.concatenate([neighbours(powers), preimages(powers, inv_max)])
    targets = element_targets(elem)
    blocks = []
    for b in bamaxes:
        for mode in ("rceil", "floor"):
            e = int(ref.mx_scale_exponent(np.array([b], F32), elem, mode)[0])
            pool = preimages(targets, F32(2.0**-e), k=1)
            pool = pool[np.abs(pool) <= b]
            blocks.append(rows(b, pool, 32, 4, rng))
    return [Case(f"mx-{elem}", _pad_rows(np.concatenate(blocks)))]


def absmax_tensor(elem: str, seed: int = 0) -> list[Case]:
    """FP8 current scaling per tensor: several tensor amaxes (one tensor each); elements on
    and beside every element boundary under ``scale = fl(max / amax)``."""
    rng = np.random.default_rng(seed)
    targets = element_targets(elem)
    cases = []
    for amax in _random_magnitudes(rng, 4, -8, 8):
        scale = np.minimum(ref.ELEM_MAX[elem] / amax, FLT_MAX)
        pool = preimages(targets, scale)
        pool = pool[np.abs(pool) <= amax]
        cases.append(Case(f"{elem} tensor amax={amax}", rows(amax, pool, 32, 96, rng)))
    return cases


def absmax_blocks(elem: str, width: int, qmax=None, seed: int = 0, tile=None) -> list[Case]:
    """Abs-max scaling per block (DeepSeek 1x128, per-channel INT): a random amax per block,
    elements on and beside the element boundaries under the block's ``fl(max / amax)``."""
    rng = np.random.default_rng(seed)
    targets = element_targets(elem)
    top = F32(qmax if qmax is not None else ref.ELEM_MAX[elem])
    n_blocks = 8 if tile else 64
    blocks = []
    for amax in _random_magnitudes(rng, n_blocks, -10, 10):
        pool = preimages(targets, np.minimum(top / amax, FLT_MAX))
        pool = pool[np.abs(pool) <= amax]
        if tile:
            blocks.append(rows(amax, pool, tile[0] * tile[1], 1, rng).reshape(tile))
        else:
            blocks.append(rows(amax, pool, width, 4, rng))
    x = np.concatenate(blocks, axis=1) if tile else _pad_rows(np.concatenate(blocks))
    return [Case(f"absmax-{elem}-{width}{'-tile' if tile else ''}", x, tile)]


def q4_0(seed: int = 0) -> list[Case]:
    """GGML Q4_0: a random signed block maximum ``m``; elements on and beside the preimages
    of every boundary of ``floor(fl(v + 8.5))`` under ``id = fl(1 / fl(m / -8))``. Also the
    input that showed XLA's FMA contraction (x[0] = 2.5, x[1] = 2.34375)."""
    rng = np.random.default_rng(seed)
    targets = q4_0_targets()
    ms = _random_magnitudes(rng, 192) * rng.choice([-1, 1], 192).astype(F32)
    blocks = []
    for m in ms:
        inv = F32(1) / (m / F32(-8))
        pool = preimages(targets, inv)
        pool = pool[np.abs(pool) < np.abs(m)]
        blocks.append(rows(m, pool, 32, 2, rng))
    issue = np.zeros((1, 32), F32)
    issue[0, :2] = 2.5, 2.34375
    return [Case("q4_0", _pad_rows(np.concatenate([issue] + blocks)))]


def division_adversarial_amaxes(divisor: float, n: int, seed: int = 0) -> np.ndarray:
    """Block amaxes whose ``fl(a / divisor)`` differs from ``fl(a * fl(1/divisor))``, or whose
    ``fl(1 / fl(a / divisor))`` differs from ``fl(divisor / a)`` (the two rewrites of a
    division XLA's simplifier makes)."""
    rng = np.random.default_rng(seed)
    a = _random_magnitudes(rng, 200_000, -10, 10)
    d = F32(divisor)
    q = a / d
    bad = (q != a * (F32(1) / d)) | ((F32(1) / q) != (d / a))
    return a[bad][:n]


def q8_0(seed: int = 0) -> list[Case]:
    """GGML Q8_0: block amaxes where a reciprocal product or ``127 / amax`` would round
    differently from ``fl(1 / fl(amax / 127))``, and amaxes whose ``d`` lands on and beside
    the midpoints of its float16 rounding; elements on and beside every ``k + 0.5`` and
    integer under ``id``. Also the input that showed the reciprocal rewrite
    (x[0] = 2.234375, x[1] = -1.1171875)."""
    rng = np.random.default_rng(seed)
    targets = element_targets("int8")
    # amaxes whose d = fl(amax / 127) sits on and beside an fp16 rounding midpoint
    fp16 = ref.fp16_value(rng.choice(np.arange(0x1400, 0x4800, dtype=np.uint16), 40))
    mids = (fp16.astype(np.float64) + ref.fp16_value(ref.fp16_bits(fp16) + 1)) / 2
    near_mid = neighbours(np.asarray(mids * 127, F32), k=2)
    amaxes = np.concatenate([division_adversarial_amaxes(127, 160, seed), near_mid])
    blocks = []
    for amax in amaxes:
        inv = F32(1) / (amax / F32(127))
        pool = preimages(targets, inv)
        pool = pool[np.abs(pool) <= amax]
        blocks.append(rows(amax * rng.choice([-1, 1]), pool, 32, 2, rng))
    issue = np.zeros((1, 32), F32)
    issue[0, :2] = 2.234375, -1.1171875
    return [Case("q8_0", _pad_rows(np.concatenate([issue] + blocks)))]


def cases(fmt: str) -> list[Case]:
    """Every adversarial case for a registry format name."""
    mx_elem = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}
    base = fmt.removesuffix("_floor")
    if fmt == "nvfp4":
        return nvfp4() + nvfp4(tile=True)
    if fmt in ("nvfp4_4over6", "nvfp4_4over6_mse"):
        return four_over_six() + four_over_six(tile=True)
    if fmt == "nvfp4_row":  # each row's own amax (1D blocks only)
        return nvfp4()
    if base in mx_elem:
        return mx(mx_elem[base])
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        return absmax_tensor(fmt[-4:])
    if fmt == "fp8_block128":
        return absmax_blocks("e4m3", 128) + absmax_blocks("e4m3", 128, tile=(128, 128))
    if fmt in ("int8", "int4"):
        return absmax_blocks(fmt, 64, qmax={"int8": 127, "int4": 7}[fmt])
    if fmt == "int8_block128":
        return absmax_blocks("int8", 128, qmax=127)
    if fmt == "int4_q4_0":
        return q4_0()
    if fmt == "int8_q8_0":
        return q8_0()
    raise ValueError(f"no adversarial generator for {fmt!r}")


FORMATS = ("nvfp4", "nvfp4_row", "nvfp4_4over6", "nvfp4_4over6_mse", "mxfp8", "mxfp8_e5m2", "mxfp4", "mxfp8_floor", "mxfp8_e5m2_floor",
           "mxfp4_floor", "fp8_e4m3", "fp8_e5m2", "fp8_block128", "int8", "int8_block128", "int4",
           "int4_q4_0", "int8_q8_0")


# ----------------------------------------------------------------------------- the oracle


def reference(fmt: str, x: np.ndarray, tile=None, global_amax=None,
              ftz: bool = False) -> dict[str, np.ndarray]:
    """The oracle's (tests/oracles/numpy_ref.py) codes, scales (as stored bits) and dequantized
    values of ``x`` for ``fmt``: ``{"codes", "scale", "values"}`` (+ ``"amax"`` for NVFP4).
    Codes are unpacked (one per element); scale layouts are fp4lab's. ``ftz``: flush float32
    subnormals as XLA:CPU does (the MX blocks at E8M0's bottom produce some)."""
    amax = None if global_amax is None else F32(global_amax)
    if fmt == "nvfp4":
        block = tile or (1, 16)
        codes, sb, a = ref.nvfp4_quantize(x, block_shape=block, amax=amax, ftz=ftz)
        return {"codes": codes, "scale": sb, "amax": a,
                "values": ref.nvfp4_dequantize(codes, sb, a, block, ftz=ftz)}
    if fmt == "nvfp4_row":  # NVFP4 on each row with the row's own amax
        rows_ = [ref.nvfp4_quantize(r[None], ftz=ftz) for r in x]
        codes = np.concatenate([c for c, _, _ in rows_])
        sb = np.concatenate([s for _, s, _ in rows_])
        return {"codes": codes, "scale": sb,
                "values": np.concatenate([ref.nvfp4_dequantize(c, s, a, ftz=ftz)
                                          for c, s, a in rows_])}
    if fmt in ("nvfp4_4over6", "nvfp4_4over6_mse"):
        block, error = tile or (1, 16), "mse" if fmt.endswith("_mse") else "mae"
        codes, sb, a = ref.nvfp4_4over6_quantize(x, block, amax, error=error, ftz=ftz)
        return {"codes": codes, "scale": sb, "amax": a,
                "values": ref.nvfp4_4over6_dequantize(codes, sb, a, block, ftz=ftz)}
    if fmt.startswith("mxfp"):
        elem = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}[fmt.removesuffix("_floor")]
        mode = "floor" if fmt.endswith("_floor") else "rceil"
        codes, sb = ref.mx_quantize(x, elem, mode, ftz=ftz)
        return {"codes": codes, "scale": sb,
                "values": ref.mx_dequantize(codes, sb, elem, ftz=ftz)}
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        elem = fmt[-4:]
        codes, _, inv = ref.fp8_tensor_quantize(x, elem, amax=amax, ftz=ftz)
        return {"codes": codes, "scale": np.asarray(inv, F32).view(np.uint32),
                "values": ref.fp8_tensor_dequantize(codes, inv, elem, ftz=ftz)}
    if fmt == "fp8_block128":
        block = tile or (1, 128)
        codes, _, inv = ref.fp8_block_quantize(x, block, "e4m3", ftz=ftz)
        return {"codes": codes, "scale": inv.view(np.uint32),
                "values": ref.fp8_block_dequantize(codes, inv, block, ftz=ftz)}
    if fmt in ("int8", "int4"):
        q, inv = ref.int_quantize(x, {"int8": 8, "int4": 4}[fmt], ftz=ftz)
        return {"codes": q, "scale": inv.view(np.uint32),
                "values": ref.int_dequantize(q, inv, ftz=ftz)}
    if fmt == "int8_block128":
        q, inv = ref.int_quantize(x, 8, axis_block=128, ftz=ftz)
        return {"codes": q, "scale": inv.view(np.uint32),
                "values": ref.int_dequantize(q, inv, axis_block=128, ftz=ftz)}
    if fmt in ("int4_q4_0", "int8_q8_0"):
        quant, dequant = {"int4_q4_0": (ref.q4_0_quantize, ref.q4_0_dequantize),
                          "int8_q8_0": (ref.q8_0_quantize, ref.q8_0_dequantize)}[fmt]
        q, d_bits = quant(x, ftz=ftz)
        return {"codes": q, "scale": d_bits, "values": dequant(q, d_bits, ftz=ftz)}
    raise ValueError(f"no oracle for {fmt!r}")
