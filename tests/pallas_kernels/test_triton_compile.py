"""Every kernel compiles to an H200 (sm_90a) binary, without a GPU.

The Triton modules JAX lowers for an abstract H200 are compiled by upstream Triton (the pip
``triton`` package, pinned in the ``compile-check`` extra) through its whole pipeline, TTIR ->
TTGIR -> LLVM IR -> PTX -> cubin, the last step by the ``ptxas`` Triton ships. On a GPU, XLA runs
its own build of the same Triton pipeline, so this is a proxy for what the GPU compiles, and a
kernel that stops compiling, spills registers or gains an approximate division fails CI.

Checks per kernel:

- it compiles, and ``ptxas -v`` reports no spill stores and no stack frame;
- the Triton module negates no float (Pallas lowers ``-x`` to ``0 - x``, which loses -0);
- the PTX has no approximate division or reciprocal (``div.full``, ``div.approx``,
  ``rcp.approx``) and no float ``min``/``max``, which return the number when the other
  operand is NaN (Triton lowers ``jnp.minimum`` to them; XLA's propagates the NaN);
- NVFP4 quantizers divide with ``div.rn.f32``;
- every float instruction of a round-to-nearest kernel is on an allowlist of exact or
  correctly rounded ones (``EXACT_FLOAT_OPS``): no ``fma`` although FP contraction is
  allowed, and no flush-to-zero variant (Triton compiles ``jnp.abs`` and ``jnp.floor`` to
  ``abs.ftz`` / ``cvt.rmi.ftz``). A stochastic-rounding kernel (bit-equal to the reference
  too) may also have the three instructions of its rounding step, each exact where it occurs
  (``SR_FLOAT_OPS``): ``cvt.rn.f32.u32`` of the 24-bit uniform (exact), ``cvt.rmi.ftz`` of
  ``floor(t)`` with ``t >= 0`` (flushing a subnormal ``t`` gives the same ``+0``), and
  ``fma(a, 2^k, -floor(t))``, the contraction of ``t - floor(t)`` with ``t = a * 2^k``: the
  product is exact (``k <= 1``, ``a`` normal when ``k < 1``) and so is the difference.

``ptxas`` may still contract a plain ``mul``/``add`` pair into an FMA; no round-to-nearest
kernel has a product feeding an addition except the RHT's multiplications by +-1, which are
exact.

    python tests/pallas_kernels/test_triton_compile.py   # prints the table (registers, ...)
"""

import re
import subprocess
import sys

import pytest
from kernel_helpers import kernel_cases, lowered, triton_modules

if not sys.platform.startswith("linux"):  # the test extra installs Triton on Linux only
    pytest.skip("pip Triton (the sm_90 compiler) has Linux wheels only", allow_module_level=True)
import triton  # noqa: E402  (missing on Linux: an error; pip install -e ".[compile-check]")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)

# The float instructions a round-to-nearest kernel may contain: correctly rounded IEEE
# arithmetic (no .ftz, .approx or .full), exact sign operations, comparisons, selects, and
# conversions that are exact or round to nearest even.
_FLOAT = r"(f32|f16|f16x2|bf16|bf16x2|e4m3x2|e5m2x2)"
EXACT_FLOAT_OPS = re.compile("|".join([
    r"(add|sub|mul)(\.rn)?\.f32", r"div\.rn\.f32", rf"(abs|neg|copysign)\.{_FLOAT}",
    r"selp\.f32", r"setp\.[a-z]+\.f32", rf"cvt\.{_FLOAT}\.{_FLOAT}",
    rf"cvt\.rn(\.satfinite)?\.{_FLOAT}\.{_FLOAT}"]))
SR_FLOAT_OPS = re.compile(r"cvt\.rn\.f32\.u32|cvt\.rmi\.ftz\.f32\.f32|fma\.rn\.f32")


def negations(ttir: str) -> list[str]:
    """The ``0 - x`` subtractions of a Triton module: how Pallas lowers ``-x``, which turns -0
    into +0 (the kernels set signs on the bits instead)."""
    zeros = set(re.findall(r"(%[\w#]+) = arith\.constant (?:dense<)?0\.000000e\+00>? : ", ttir))
    zeros |= {z for z, c in re.findall(r"(%[\w#]+) = tt\.splat (%[\w#]+) ", ttir) if c in zeros}
    return [z for z in re.findall(r"arith\.subf (%[\w#]+), ", ttir) if z in zeros]


def float_ops(ptx: str) -> set[str]:
    """The opcodes of the PTX instructions that name a floating-point type."""
    ops = set()
    for line in ptx.splitlines():
        line = re.sub(r"^\s*@!?%\w+\s+", "", line).strip()  # drop a predicate guard
        if line and line[0] not in ".{}/" and not line.endswith(":"):
            op = line.split()[0]
            if re.search(r"\.(b?f(16|32|64)(x2)?|e4m3x2|e5m2x2)(\.|$)", op):
                ops.add(op)
    return ops


def compile_for_h200(ttir: str, num_warps: int, num_stages: int, tmp_path):
    """PTX and ``ptxas -v`` statistics of one TTIR module compiled for sm_90a."""
    src = tmp_path / "kernel.ttir"
    src.write_text(ttir)
    kernel = triton.compile(str(src), target=H200,
                            options=dict(num_warps=num_warps, num_stages=num_stages,
                                         enable_fp_fusion=True))
    ptx = kernel.asm["ptx"]
    (tmp_path / "kernel.ptx").write_text(ptx)
    report = subprocess.run(
        [get_ptxas(90).path, "-arch=sm_90a", "-v", str(tmp_path / "kernel.ptx"), "-o",
         str(tmp_path / "kernel.cubin")], capture_output=True, text=True, check=True).stderr

    def stat(pattern):
        return int(re.search(pattern, report).group(1))

    return ptx, dict(registers=stat(r"Used (\d+) registers"),
                     spill_stores=stat(r"(\d+) bytes spill stores"),
                     stack=stat(r"(\d+) bytes stack frame"),
                     fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
                     div_rn=len(re.findall(r"\bdiv\.rn\.f32\b", ptx)))


@pytest.mark.parametrize("name", sorted(kernel_cases()))
def test_kernel_compiles_for_h200_without_spills_or_approximate_division(name, tmp_path):
    # 256 x 512, and 65536 x 65536 (8 GiB of BF16: Pallas switches to 64-bit offsets); an SR
    # kernel counts positions in 32 bits and is refused 2**32 elements, so 65520 x 65536
    stochastic = lowered(name).stochastic
    modules = []
    for shape in [(256, 512), (65520 if stochastic else 65536, 65536)]:
        modules += lowered(name, shape).modules  # (shared with test_quantize_kernels)
    assert any("xi64>" in ttir for _, ttir, _, _ in modules[len(modules) // 2:])  # offsets
    for module, ttir, num_warps, num_stages in modules:
        assert not negations(ttir), (module, "a float negation loses -0")
        ptx, stats = compile_for_h200(ttir, num_warps, num_stages, tmp_path)
        assert stats["spill_stores"] == 0 and stats["stack"] == 0, (module, stats)
        assert not re.search(r"\b(div\.full|div\.approx|rcp\.approx)", ptx), module
        # float min/max that drop NaN (minNum semantics; XLA's jnp.minimum propagates it)
        assert not re.search(r"\b(min|max)(\.ftz)?\.f32\b", ptx), module
        if "nvfp4" in module and "dequantize" not in module and "amax" not in module:
            assert stats["div_rn"] > 0, (module, stats)
        # every float instruction exact or correctly rounded
        inexact = {op for op in float_ops(ptx) if not EXACT_FLOAT_OPS.fullmatch(op)
                   and not (stochastic and SR_FLOAT_OPS.fullmatch(op))}
        assert not inexact, (module, inexact)


if __name__ == "__main__":
    import pathlib
    import tempfile

    print(f"{'kernel':40s} {'module':28s} warps regs spills fma div.rn")
    for name, (f, args, _) in kernel_cases().items():
        for module, ttir, warps, stages in triton_modules(f, *args):
            with tempfile.TemporaryDirectory() as tmp:
                _, s = compile_for_h200(ttir, warps, stages, pathlib.Path(tmp))
            print(f"{name:40s} {module:28s} {warps:5d} {s['registers']:4d} "
                  f"{s['spill_stores']:6d} {s['fma']:3d} {s['div_rn']:6d}")
