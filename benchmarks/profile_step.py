"""Benchmark: where a training step's time goes on XLA:CPU: the GEMMs, each quantized
operand's quantizer, fp4lab's probes, collectives, and the rest of the model and optimizer.

XLA:CPU's profiler records one event per executed op (a thunk: a fusion, a dot, a copy, ...)
with the op's name and its program's name. The optimized program's text says what each op
computes, and fp4lab names the scope of every operand's quantization ``fp4lab.<operand>``
(``fprop_x`` ... ``wgrad_dy``), its GEMM ``fp4lab.gemm`` and its probes ``fp4lab.probes``. An op
is attributed, in this order, to:

* ``gemm``: a dot or convolution, or a fusion that contains one;
* ``collectives``: an all-reduce, all-gather, reduce-scatter, all-to-all or collective permute;
* ``quantize <operand>``, ``probes``, ``gemm epilogue`` (the scaling after the product): the
  fp4lab scope most of the op's fused instructions carry;
* ``other``: everything else (the model's own elementwise work, the optimizer, copies).

Control flow (``while``, ``conditional``, ``call``) is not counted: its thunk's time is its
body's ops, which are. Event times are summed over every device and thread, so on simulated
devices sharing cores the sum exceeds the wall time; the shares are what to read. They are
shares of the compute, the ops outside collectives: a collective's time includes waiting for
the other devices.

Two sources:

    python benchmarks/profile_step.py --recipes bf16,nvfp4,mxfp8 [--dim 256 --tokens 1024]
        benchmarks/train_step.py's model, profiled in this process
    python benchmarks/profile_step.py --xplane DIR --hlo DIR --steps N
        a profile written elsewhere: MaxText with ``profiler=xplane`` (DIR: its output),
        run with ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``
        (``benchmarks/maxtext_step.py --profile`` does both)
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
import time
import warnings
from pathlib import Path

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CONTROL = ("while", "conditional", "call")
GEMM_OPS = ("dot", "convolution")
SCOPE = re.compile(r"fp4lab\.(\w+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}]*?)\}?(?:,|$)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class Op:
    """One instruction of an optimized HLO program: its opcode, the ``op_name`` its
    metadata carries, and the computations it calls (a fusion's fused computation)."""

    def __init__(self, opcode: str, op_name: str, calls: list[str]):
        self.opcode, self.op_name, self.calls = opcode, op_name, calls


def parse_hlo(text: str) -> tuple[dict[str, Op], dict[str, list[str]]]:
    """``(ops by instruction name, instruction names by computation name)`` of one HLO
    module's text (``compiled.as_text()``, or XLA's ``*after_optimizations.txt`` dump)."""
    ops: dict[str, Op] = {}
    computations: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault(head.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            calls = [c.strip().lstrip("%") for found in _CALLS.findall(line)
                     for c in found.split(",") if c.strip()]
            name_ = _OP_NAME.search(line)
            ops[m.group(1)] = Op(m.group(2), name_.group(1) if name_ else "", calls)
            current.append(m.group(1))
    return ops, computations


def _fused(op: Op, ops: dict[str, Op], computations: dict[str, list[str]]) -> list[Op]:
    """``op`` and every instruction of the computations it calls, recursively."""
    out, todo, seen = [op], list(op.calls), set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for name in computations.get(c, ()):
            out.append(ops[name])
            todo.extend(ops[name].calls)
    return out


def category(op: Op, ops: dict[str, Op], computations: dict[str, list[str]]) -> str | None:
    """What ``op``'s time is attributed to (the module doc's rules); None for control flow."""
    if op.opcode in CONTROL:
        return None
    inside = _fused(op, ops, computations)
    if any(o.opcode in GEMM_OPS for o in inside):
        return "gemm"
    if any(o.opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVES
           for o in inside):
        return "collectives"
    scopes = collections.Counter(s for o in inside for s in SCOPE.findall(o.op_name))
    if not scopes:
        return "other"
    scope = scopes.most_common(1)[0][0]
    return {"gemm": "gemm epilogue", "probes": "probes"}.get(scope, f"quantize {scope}")


def read_events(xplane: Path):
    """``(program name, op name, duration ns)`` of every op event in an ``.xplane.pb``."""
    from jax.profiler import ProfileData

    for plane in ProfileData.from_file(str(xplane)).planes:
        for line in plane.lines:
            for event in line.events:
                with warnings.catch_warnings():  # jaxlib's event_stats type has no __module__
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(event.stats)
                if "hlo_op" in stats and "hlo_module" in stats:
                    yield stats["hlo_module"], stats["hlo_op"], event.duration_ns


def attribute(events, programs: dict[str, str]) -> dict[str, float]:
    """Nanoseconds per category over ``events`` (``read_events``), ``programs``: each
    program's optimized HLO text by its name; ops of other programs are ``other programs``."""
    parsed = {name: parse_hlo(text) for name, text in programs.items()}
    cache: dict[tuple[str, str], str | None] = {}
    totals: dict[str, float] = collections.Counter()
    for module, op_name, ns in events:
        key = (module, op_name)
        if key not in cache:
            if module not in parsed:
                cache[key] = "other programs"
            else:
                ops, comps = parsed[module]
                cache[key] = category(ops[op_name], ops, comps) if op_name in ops else "other"
        if cache[key] is not None:
            totals[cache[key]] += ns
    return dict(totals)


def module_name(text: str) -> str | None:
    """The name of the HLO module ``text`` holds (what profile events call its program)."""
    m = re.match(r"HloModule ([\w.\-]+)", text)
    return m.group(1) if m else None


def dumped_programs(hlo_dir: Path) -> dict[str, str]:
    """The optimized programs XLA dumped (``--xla_dump_to``), by module name."""
    texts = (f.read_text() for f in sorted(hlo_dir.glob("*after_optimizations.txt")))
    return {module_name(t): t for t in texts if module_name(t)}


def table(rows: dict[str, dict[str, float]], steps: dict[str, int]) -> str:
    """A Markdown table: ms per step of each category (columns: the profiled variants) and
    its share of the variant's compute, the op time outside collectives. A collective's
    time includes its wait for the other devices (on simulated devices sharing the cores,
    most of it), so it gets no share."""
    names = sorted({c for r in rows.values() for c in r} - {"collectives"},
                   key=lambda c: (c.startswith("quantize"), c))
    head = "| category | " + " | ".join(f"{v} ms/step (share)" for v in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]
    for c in [*names, "compute", "collectives"]:
        cells = []
        for v, r in rows.items():
            compute = sum(ns for k, ns in r.items() if k != "collectives")
            ns = compute if c == "compute" else r.get(c, 0.0)
            ms = f"{ns / steps[v] / 1e6:.2f}"
            cells.append(ms if c == "collectives" or not compute
                         else f"{ms} ({100 * ns / compute:.0f} %)")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_recipe(recipe: str, dim: int, layers: int, tokens: int, steps: int):
    """Profiles ``steps`` steps of benchmarks/train_step.py's model under ``recipe``:
    (ns per category, wall seconds per step)."""
    import jax
    import train_step  # benchmarks/ is on the path when this runs as a script

    params = train_step.init(jax.random.key(2), layers, dim)
    x = jax.random.normal(jax.random.key(0), (tokens, dim))
    keys = jax.random.split(jax.random.key(1), steps + 1)
    step = train_step.make_step(recipe).lower(params, x, keys[0]).compile()  # compiled once
    text = step.as_text()
    params, loss = step(params, x, keys[0])
    jax.block_until_ready(loss)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for k in keys[1:]:
            params, loss = step(params, x, k)
        jax.block_until_ready(loss)
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        (xplane,) = Path(d).rglob("*.xplane.pb")
        return attribute(read_events(xplane), {module_name(text): text}), wall


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="bf16,nvfp4,mxfp8", help="comma list")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--xplane", type=Path, help="a folder holding one profile's .xplane.pb")
    ap.add_argument("--hlo", type=Path, help="XLA's dump folder of the profiled programs")
    ap.add_argument("--name", default="profile", help="the column of an --xplane profile")
    args = ap.parse_args(argv)
    if args.xplane:
        if not args.hlo:
            raise SystemExit("--xplane needs --hlo: the dump of the programs it profiled")
        found = sorted(args.xplane.rglob("*.xplane.pb"))
        if len(found) != 1:
            raise SystemExit(f"--xplane {args.xplane}: {len(found)} .xplane.pb files, not 1")
        programs = dumped_programs(args.hlo)
        if not programs:
            raise SystemExit(f"--hlo {args.hlo}: no *after_optimizations.txt (give XLA "
                             "--xla_dump_to and --xla_dump_hlo_as_text)")
        print(table({args.name: attribute(read_events(found[0]), programs)},
                    {args.name: args.steps}))
        return
    rows, walls = {}, {}
    for r in args.recipes.split(","):
        rows[r], walls[r] = profile_recipe(r, args.dim, args.layers, args.tokens, args.steps)
    print(f"{args.layers} blocks of {args.dim} -> {4 * args.dim} -> {args.dim}, {args.tokens} "
          f"tokens, {args.steps} profiled steps; wall ms/step: "
          + ", ".join(f"{r} {w * 1e3:.1f}" for r, w in walls.items()))
    print(table(rows, dict.fromkeys(rows, args.steps)))


if __name__ == "__main__":
    main()
