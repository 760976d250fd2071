"""No float rewrite by XLA may change a quantizer's bits (docs/numerics.md, "Rewrite audit").

XLA contracts ``a * b + c`` into an FMA, replaces a division by a constant or a broadcast
scalar with a reciprocal product, and folds and reassociates constants, on CPU and GPU alike.
Three kinds of test hold the quantizers to their formulas anyway:

* adversarial inputs (``tests/adversarial.py``: values on and one ulp beside every rounding
  boundary after each intermediate product) against the NumPy oracle, bit for bit, in the
  contexts where the rewrites bite: inside the quantizer's own jit, under a caller's jit
  that makes the amax or the whole QArray a constant, and with a consumer that adds to the
  dequantized values; on the XLA path and on the kernels (interpret mode off the GPU);
* each defence removed in turn: the adversarial comparison must then fail (so it can);
* what the compiler produced: no float constant that the formulas do not contain (a folded
  reciprocal or a reassociated product), no product that flows into an addition, in the
  optimized CPU HLO and in the StableHLO lowered for CUDA, and no FMA instruction in the
  CPU machine code.

``scripts/gpu-check`` runs this file on a GPU, where the kernels are compiled.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys

import adversarial as adv
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4lab
from fp4lab.numerics import quantize as quantize_module
from fp4lab.numerics import rounding
from fp4lab.numerics.scaling import GGMLQ4_0Scale
from pallas_kernels.quantize import supports

F32 = np.float32
GLOBAL_AMAX = ("nvfp4", "nvfp4_4over6", "nvfp4_4over6_mse", "fp8_e4m3", "fp8_e5m2")


@functools.cache
def cases(fmt):
    return adv.cases(fmt)


@functools.cache
def oracle(fmt, i, global_amax=None):
    """The oracle's answer for case ``i``; with XLA:CPU's flush of subnormals on a CPU."""
    c = cases(fmt)[i]
    return adv.reference(fmt, c.x, c.tile, global_amax, ftz=jax.default_backend() == "cpu")


def codes_of(q) -> np.ndarray:
    """One code per element, as the oracle gives them (E2M1 nibbles as uint8, FP8 bytes,
    INT4 and Q4_0 nibbles as signed int8)."""
    data = q.data
    if q.format.element.packed:
        data = rounding.unpack_nibbles(data, q.axis)
    data = np.asarray(data)
    if q.format.element.kind == "int" and q.format.element.packed:
        return ((data.astype(np.int16) ^ 8) - 8).astype(np.int8)
    return data.view(np.uint8) if data.dtype.itemsize == 1 and data.dtype != np.int8 else data


def scale_bits(q) -> np.ndarray:
    s = np.asarray(q.scale)
    return s.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[s.dtype.itemsize])


def count_different(got, want) -> int:
    """Elements whose bits differ (all NaNs equal); a shape mismatch counts every element."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return max(got.size, want.size)
    if got.dtype.kind == "f":
        g, w = got.astype(F32), want.astype(F32)
        both_nan = np.isnan(g) & np.isnan(w)
        return int(((g.view(np.uint32) != w.view(np.uint32)) & ~both_nan).sum())
    return int((got != want).sum())


def _consumer_term(shape) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(F32)


def mismatches(fmt, context, backend="xla") -> dict[str, int]:
    """Mismatching elements per compared quantity, summed over the adversarial cases.

    ``context``: ``"plain"`` (fp4lab's own jits), ``"constant"`` (the caller's jit makes
    ``global_amax``, or the whole QArray, a compile-time constant) or ``"consumer"`` (the
    caller adds to the dequantized values in the same jit)."""
    out: dict[str, int] = {}

    def add(name, got, want):
        out[name] = out.get(name, 0) + count_different(got, want)

    for i, c in enumerate(cases(fmt)):
        x = jnp.asarray(c.x)
        kw = dict(tile=c.tile, backend=backend)
        deq = "xla" if c.tile else backend  # tiled QArrays have no dequantize kernel
        if context == "plain":
            want = oracle(fmt, i)
            q = fp4lab.quantize(x, fmt, **kw)
            add("codes", codes_of(q), want["codes"])
            add("scales", scale_bits(q), want["scale"])
            add("dequantize", fp4lab.dequantize(q, backend=deq), want["values"])
            add("fake_quant", fp4lab.fake_quant(x, fmt, **kw), want["values"])
        elif context == "constant":
            q = fp4lab.quantize(x, fmt, **kw)
            add("dequantize(constant QArray)", jax.jit(lambda q=q: fp4lab.dequantize(q))(),
                oracle(fmt, i)["values"])
            if fmt in GLOBAL_AMAX:
                amax = float(np.max(np.abs(c.x))) * 1.25  # a literal the caller's jit holds
                want = oracle(fmt, i, amax)
                got = jax.jit(lambda x: fp4lab.fake_quant(x, fmt, global_amax=amax, **kw))(x)
                add("fake_quant(constant global_amax)", got, want["values"])
                qc = jax.jit(lambda x: fp4lab.quantize(x, fmt, global_amax=amax, **kw))(x)
                add("codes(constant global_amax)", codes_of(qc), want["codes"])
        elif context == "consumer":
            r = _consumer_term(c.x.shape)
            want = oracle(fmt, i)["values"] + r  # float32 sums of the rounded values
            add("fake_quant(x) + r",
                jax.jit(lambda x, r: fp4lab.fake_quant(x, fmt, **kw) + r)(x, r), want)
            q = fp4lab.quantize(x, fmt, **kw)
            add("dequantize(q) + r",
                jax.jit(lambda q, r: fp4lab.dequantize(q, backend=deq) + r)(q, r), want)
        else:
            raise ValueError(context)
    return out


def assert_no_mismatch(counts, what):
    bad = {k: v for k, v in counts.items() if v}
    assert not bad, f"{what}: elements that differ from the oracle: {bad}"


# ----------------------------------------------------------------------------- adversarial


@pytest.mark.parametrize("context", ["plain", "constant", "consumer"])
@pytest.mark.parametrize("fmt", adv.FORMATS)
def test_adversarial_inputs_match_the_oracle(fmt, context):
    assert_no_mismatch(mismatches(fmt, context), f"{fmt} ({context}, XLA)")


KERNEL_FORMATS = [f for f in adv.FORMATS
                  if supports(fp4lab.get_format(f), -1, None, "nearest") is None]


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_adversarial_inputs_on_the_kernels(fmt):
    """The same inputs through the Pallas kernels (compiled on a GPU, interpret mode here)."""
    assert_no_mismatch(mismatches(fmt, "plain", backend="pallas"), f"{fmt} (kernels)")


def test_the_two_inputs_of_the_issue_match_ggml():
    """x = [2.5, 2.34375]: Q4_0 code -7 (2.1875), which an FMA turned into -8 (2.5);
    x = [2.234375, -1.1171875]: Q8_0 codes [127, -63], which amax * fl(1/127) made -64."""
    x = np.zeros((1, 32), F32)
    x[0, :2] = 2.5, 2.34375
    q = fp4lab.quantize(jnp.asarray(x), "int4_q4_0")
    assert codes_of(q)[0, 1] == -7 and float(fp4lab.dequantize(q)[0, 1]) == 2.1875
    x[0, :2] = 2.234375, -1.1171875
    q = fp4lab.quantize(jnp.asarray(x), "int8_q8_0")
    assert codes_of(q)[0, :2].tolist() == [127, -63]


@pytest.mark.parametrize("fmt", ["int4_q4_0", "int8_q8_0"])
def test_ggml_adversarial_inputs_match_the_gguf_package(fmt):
    """GGML's own Python quantizer (``gguf.quants``, shipped with llama.cpp) on the same
    adversarial blocks: the same fp16 scales and the same dequantized values, bit for bit."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    qtype = {"int4_q4_0": gguf.GGMLQuantizationType.Q4_0,
             "int8_q8_0": gguf.GGMLQuantizationType.Q8_0}[fmt]
    for c in cases(fmt):
        blocks = quants.quantize(c.x, qtype)
        q = fp4lab.quantize(jnp.asarray(c.x), fmt)
        per_block = blocks.reshape(c.x.shape[0], c.x.shape[1] // 32, -1)
        d_bits = per_block[..., :2].copy().view(np.uint16)[..., 0]  # each block starts with d
        np.testing.assert_array_equal(scale_bits(q), d_bits)
        assert count_different(fp4lab.dequantize(q), quants.dequantize(blocks, qtype)) == 0


# ----------------------------------------------------------------------------- defences removed


def _naive_div(a, b):
    return jnp.asarray(a, jnp.float32) / jnp.asarray(b, jnp.float32)


def _naive_q4_0_rounding(self, v, element):
    return jnp.minimum(jnp.floor(v + F32(8.5)), F32(15)) - F32(8)


DEFENCES = {
    # defence: (what replaces it, formats and context where its absence must show)
    "rounding.div (opaque operands and quotient)":
        ((rounding, "div", _naive_div), ["int8_q8_0"], "plain"),
    "Q4_0 code without an addition":
        ((GGMLQ4_0Scale, "round_nearest", _naive_q4_0_rounding), ["int4_q4_0"], "plain"),
    "opaque scales before decoding":
        ((quantize_module, "opaque_scales", lambda s, a: (s, a)), ["nvfp4"],
         "constant"),
    "rounded dequantized output":
        ((quantize_module, "rounded_output", lambda y: y), ["nvfp4", "fp8_e4m3", "int8"],
         "consumer"),
}


@pytest.fixture
def fresh_traces(monkeypatch):
    """Patching a function that jitted code calls needs new traces: clear JAX's caches
    before the test and again before the patch is undone."""
    jax.clear_caches()
    yield monkeypatch
    jax.clear_caches()


@pytest.mark.parametrize("defence", list(DEFENCES))
def test_each_defence_is_needed(defence, fresh_traces):
    """Without the defence the adversarial inputs expose the rewrite (the note of issue 11
    lists the counts this prints)."""
    (owner, name, replacement), formats, context = DEFENCES[defence]
    fresh_traces.setattr(owner, name, replacement)
    for fmt in formats:
        counts = mismatches(fmt, context)
        print(f"{defence} removed: {fmt} ({context}): {counts}")
        assert sum(counts.values()) > 0, f"{fmt}: removing '{defence}' changed nothing"


# ----------------------------------------------------------------------------- compiled code


def _rtn_programs():
    """name -> (function, abstract args): every round-to-nearest quantizer path of every
    format, also under a caller's jit with a constant amax and with a consumer's addition."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    out = {}
    for fmt in adv.FORMATS:
        tile = (16, 16) if fmt == "nvfp4" else None
        for t in {None, tile}:
            kw = {"tile": t, "backend": "xla"}
            tag = f"{fmt}{'-tile' if t else ''}"
            q = jax.eval_shape(lambda x, kw=kw, f=fmt: fp4lab.quantize(x, f, **kw), x)
            out[f"quantize {tag}"] = (lambda x, kw=kw, f=fmt: fp4lab.quantize(x, f, **kw), (x,))
            out[f"fake_quant {tag}"] = (lambda x, kw=kw, f=fmt: fp4lab.fake_quant(x, f, **kw),
                                        (x,))
            out[f"dequantize {tag}"] = (lambda q: fp4lab.dequantize(q, backend="xla"), (q,))
            out[f"fake_quant + r {tag}"] = (
                lambda x, r, kw=kw, f=fmt: fp4lab.fake_quant(x, f, **kw) + r, (x, x))
            if fmt in GLOBAL_AMAX:
                out[f"fake_quant constant amax {tag}"] = (
                    lambda x, kw=kw, f=fmt: fp4lab.fake_quant(x, f, global_amax=3.0001, **kw),
                    (x,))
    return out


def _f32(text: str) -> float:
    text = text.strip()
    if text.lower().startswith("0x"):
        return float(np.array(int(text, 16), np.uint32).view(F32))
    return float(F32(float(text)))


def _stablehlo_constants(text):
    pat = r"dense<([^>\[\]\"]+)> : tensor<(?:[0-9x]*x)?f32>"
    return {_f32(m.group(1)) for m in re.finditer(pat, text)}


def _hlo_constants(text):
    pat = r"f32\[[0-9,]*\](?:\{[0-9,]*\})? constant\(([^)\{]+)\)"
    return {_f32(m.group(1)) for m in re.finditer(pat, text)}


def _made_constants(lowered, optimized: str) -> set:
    """Float constants of the optimized program that the program XLA was given does not
    contain (signs aside: XLA may negate a constant to fold a subtraction)."""
    given = _stablehlo_constants(lowered.as_text())
    return {v for v in _hlo_constants(optimized)
            if not np.isnan(v) and v not in given and -v not in given}


# operations a product flows through unchanged in value or in what a compiler sees of it
_THROUGH = {"broadcast", "broadcast_in_dim", "reshape", "transpose", "slice", "convert",
            "bitcast", "copy", "select", "clamp", "minimum", "maximum", "negate",
            "concatenate", "pad", "dynamic_slice", "dynamic-slice"}
_FLOATS = ("f32", "bf16", "f16", "f64")


def _is_float(t) -> bool:
    return str(t).split("<")[-1].split("x")[-1].rstrip(">") in _FLOATS


def stablehlo_product_fed_additions(module) -> list[str]:
    """Float additions and subtractions of a StableHLO module one of whose operands is a
    float product, directly or through the ops of ``_THROUGH``, across function calls,
    ``case`` branches and function arguments (XLA inlines them all before it fuses): the
    pairs a compiler could contract into an FMA."""
    from jax._src.lib.mlir import ir

    funcs, calls, ops = {}, {}, []

    def walk(op):
        op = op.operation
        ops.append(op)
        if op.name == "func.func":
            funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op
        if op.name in ("func.call", "call"):
            calls.setdefault(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, []).append(op)
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    walk(child)

    for op in module.body.operations:
        walk(op)

    def returned(region, index):
        return [blk.operations[len(blk.operations) - 1].operands[index] for blk in region.blocks]

    def product(value, depth=0) -> bool:
        if depth > 40:
            return False
        owner = value.owner
        if isinstance(owner, ir.Block):  # a function's (or a region's) argument
            parent = owner.owner.operation
            if parent.name != "func.func":
                return False
            name = ir.StringAttr(parent.attributes["sym_name"]).value
            i = ir.BlockArgument(value).arg_number
            return any(product(c.operands[i], depth + 1) for c in calls.get(name, ()))
        op, i = owner.operation, ir.OpResult(value).result_number
        kind = op.name.split(".")[-1]
        if kind == "multiply":
            return _is_float(value.type)
        if kind in _THROUGH:
            return any(product(o, depth + 1) for o in op.operands)
        if op.name in ("func.call", "call"):
            callee = funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value]
            return any(product(v, depth + 1) for v in returned(callee.regions[0], i))
        if kind in ("case", "if"):
            return any(product(v, depth + 1) for r in op.regions for v in returned(r, i))
        return False

    return [str(op)[:160] for op in ops
            if op.name in ("stablehlo.add", "stablehlo.subtract")
            and _is_float(op.results[0].type) and any(product(o) for o in op.operands)]


def hlo_product_fed_additions(text: str) -> list[str]:
    """The same for XLA's optimized HLO text, computation by computation: after fusion a
    product and an addition in different computations are in different kernels."""
    found = []
    for body in re.split(r"\n(?=\S)", text):  # computations start in column 0
        defs = {}
        for line in body.splitlines():
            m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (\S+) ([\w-]+)\((.*)", line)
            if m:
                name, typ, op, rest = m.groups()
                defs[name] = (op, re.findall(r"%[\w.-]+", rest.split("),")[0]),
                              typ.startswith(_FLOATS))

        def product(v, depth=0):
            op, operands, is_float = defs.get(v, (None, (), False))
            if op == "multiply":
                return is_float
            return (op in _THROUGH and depth < 40
                    and any(product(o, depth + 1) for o in operands))

        found += [f"{name} = {op}({', '.join(operands)})"
                  for name, (op, operands, is_float) in defs.items()
                  if op in ("add", "subtract") and is_float and any(map(product, operands))]
    return found


def _cuda_module(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")


def test_optimized_quantizers_hold_no_new_constant_and_no_contractible_product():
    """Every round-to-nearest quantizer path, compiled once for the default backend (CPU
    here, the GPU in gpu-check):

    - XLA made no float constant: a folded reciprocal (``fl(1/127)`` for ``amax / 127``) or
      a reassociated product of constants (``fl(amax * fl(1/2688))``) would show as one;
    - no float product reaches an addition, in that program and lowered for CUDA (no GPU
      needed): nothing that a compiler could contract into an FMA. The consumer's ``+ r``
      after fake_quant included: the rounded output's barrier separates them."""
    for name, (f, args) in _rtn_programs().items():
        cuda = stablehlo_product_fed_additions(_cuda_module(f, *args))
        assert not cuda, f"{name} (lowered for CUDA): {cuda}"
        lowered = jax.jit(f).lower(*args)
        optimized = lowered.compile().as_text()
        new = _made_constants(lowered, optimized)
        assert not new, f"{name}: XLA made constants {sorted(new)}"
        opt = hlo_product_fed_additions(optimized)
        assert not opt, f"{name} (optimized for {jax.default_backend()}): {opt}"


def test_the_product_check_sees_contractible_pairs():
    """The check above is not vacuous: it flags a product added to directly, through a
    function call and a broadcast, and across a function argument."""
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    inner = jax.jit(lambda x: x * 3.0)
    adds = jax.jit(lambda p: jnp.floor(p + 8.5))
    for f in (lambda x: jnp.floor(x * 3.0 + 8.5),  # the Q4_0 rounding that XLA contracted
              lambda x: inner(x)[:, :1] + x,
              lambda x: adds(x * 3.0)):
        assert stablehlo_product_fed_additions(_cuda_module(f, x))
    assert hlo_product_fed_additions(jax.jit(lambda x: x * 3.0 + 8.5).lower(x).compile()
                                     .as_text())


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux",
                    reason="disassembles x86-64 ELF objects")
def test_cpu_machine_code_has_no_fma_or_approximate_reciprocal(tmp_path):
    """XLA:CPU compiles each fusion to machine code, where LLVM contracts products and
    additions it sees together: compile every round-to-nearest quantizer path in a process
    that dumps XLA's object files, disassemble them, and find no FMA instruction and no
    approximate reciprocal (``rcp``/``rsqrt``)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    tests = os.path.dirname(os.path.dirname(__file__))
    dump = tmp_path / "dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump}")
    # run from the repository root ('' first on sys.path: fp4lab is the package, not the
    # tests/fp4lab folder); this module is loaded from its file
    compile_all = ("import importlib.util as u, sys; sys.path.insert(1, sys.argv[1])\n"
                   "spec = u.spec_from_file_location('test_rewrites', sys.argv[2])\n"
                   "t = u.module_from_spec(spec); spec.loader.exec_module(t)\n"
                   "import jax\n"
                   "for f, args in t._rtn_programs().values():\n"
                   "    jax.jit(f).lower(*args).compile()\n")
    subprocess.run([sys.executable, "-c", compile_all, tests, __file__], env=env, check=True,
                   timeout=600, cwd=os.path.dirname(tests))
    objects = sorted(dump.glob("*.o"))
    assert len(objects) >= len(_rtn_programs()), f"only {len(objects)} object files dumped"
    fma = re.compile(r"\bv?f(?:n)?m(?:add|sub)\w*[ps][sd]\b")
    approx = re.compile(r"\bv?(?:rcp|rsqrt)\w*[ps]s\b")
    bad = {}
    for obj in objects:
        asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], check=True,
                             capture_output=True, text=True).stdout
        if hits := fma.findall(asm) + approx.findall(asm):
            bad[obj.name] = sorted(set(hits))
    assert not bad, f"FMA or approximate reciprocal instructions in quantizer code: {bad}"
