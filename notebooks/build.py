"""Write the notebooks from the cell sources below (outputs stripped), so that they are
reviewed as code and regenerated in one step: ``python notebooks/build.py``.

Notebooks import fp4lab and experiments and hold no logic of their own beyond plotting.
``tests/test_notebooks.py`` executes each one top to bottom and checks that the committed
files equal what this script writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).parent

FORMATS = [
    ("md", """# 1. Number formats: grids, scales, and what they do to a tensor

fp4lab's formats are data (`fp4lab.numerics.formats`). This notebook draws the element grids, shows
how NVFP4's two-level scaling and MX's power-of-two scales cover dynamic range, and measures every
format's error and underflow on several distributions."""),
    ("code", """import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
import fp4lab
from fp4lab.numerics.formats import FORMATS, E2M1, E4M3, E5M2
from fp4lab.cli import DISTRIBUTIONS

print(fp4lab.__version__)"""),
    ("md", """## The element grids
Every representable non-negative value of E2M1 (FP4), E4M3 and E5M2 (FP8), from the formats'
own code tables, on a log axis. E2M1 has 8 magnitudes; E4M3 trades range for precision
against E5M2. E8M0 (the MX scale) is every power of two from 2^-127 to 2^127."""),
    ("code", """from fp4lab.numerics.rounding import decode

def grid(el):
    codes = jnp.arange(2 ** (el.bits - 1), dtype=jnp.uint8)  # the non-negative codes
    if el.packed:
        vals = decode(codes, el)
    else:
        vals = jax.lax.bitcast_convert_type(codes, el.storage).astype(jnp.float32)
    vals = np.asarray(vals)
    return np.unique(vals[np.isfinite(vals) & (vals > 0)])

fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), height_ratios=[3, 1])
for i, el in enumerate([E2M1, E4M3, E5M2]):
    g = grid(el)
    axes[0].scatter(g, np.full(g.size, i), marker="|", s=120)
    print(f"{el.name}: {g.size} positive values from {g.min():.3g} to {g.max():.6g}")
axes[0].set_xscale("log", base=2)
axes[0].set_yticks(range(3), ["E2M1", "E4M3", "E5M2"])
axes[0].set_title("positive values of the element formats (denser where precision is higher)")
g = grid(E2M1)
axes[1].scatter(g, np.zeros(g.size), marker="|", s=300)
for v in g:
    axes[1].annotate(f"{v:g}", (v, 0), textcoords="offset points", xytext=(0, 10), ha="center")
axes[1].set_yticks([]); axes[1].set_xlim(-0.2, 6.5); axes[1].set_title("E2M1 on a linear axis")
plt.tight_layout(); plt.show()
print("E8M0, the MX block scale: every power of two from 2^-127 to 2^127 (byte 0xFF is NaN)")"""),
    ("md", """## Two-level scaling covers the dynamic range
A tensor whose rows span 12 orders of magnitude, quantized to NVFP4 (E4M3 block scale ×
FP32 tensor scale) and to MXFP4 (E8M0 power-of-two block scale): the relative error per row
shows where each format's scales run out, and the per-row underflow shows values that
quantize to zero."""),
    ("code", """rows = 2.0 ** np.linspace(-40, 0, 64)
x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)) * rows[:, None], jnp.float32)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
for fmt in ["nvfp4", "mxfp4", "mxfp8", "fp8_e4m3"]:
    y = fp4lab.fake_quant(x, fmt)
    rel = np.linalg.norm(np.asarray(y - x), axis=1) / np.linalg.norm(np.asarray(x), axis=1)
    under = np.mean((np.asarray(y) == 0) & (np.asarray(x) != 0), axis=1)
    axes[0].plot(rows, rel, label=fmt)
    axes[1].plot(rows, 100 * under, label=fmt)
for ax, title in zip(axes, ["relative error per row", "underflow % per row"], strict=True):
    ax.set_xscale("log", base=2); ax.set_xlabel("row scale"); ax.set_title(title); ax.legend()
axes[0].set_yscale("log")
plt.tight_layout(); plt.show()"""),
    ("md", """Per-tensor FP8 flushes the small rows entirely: one scale serves the whole tensor. The
block formats rescale every 16 or 32 values; NVFP4's E4M3 block scales span about 2^17
relative to the tensor's amax, MX's E8M0 scales span 2^254, so MXFP4 keeps tiny rows that
NVFP4 loses, at a coarser (power-of-two) scale granularity."""),
    ("md", """## Error and underflow of every format on several distributions
The distributions are those of `fp4lab compare` (`fp4lab.cli.DISTRIBUTIONS`): Gaussian,
Student-t, log-normal, outlier channels and gradient-like tensors."""),
    ("code", """names = [n for n in ["nvfp4", "mxfp8", "mxfp8_e5m2", "mxfp4", "fp8_e4m3", "fp8_e5m2",
                     "fp8_block128", "int8", "int4", "int4_q4_0"] if n in FORMATS]
rng = np.random.default_rng(0)
table = {}
for dist, make in DISTRIBUTIONS.items():
    t = jnp.asarray(make(rng, 256 * 1024).reshape(256, 1024), jnp.bfloat16)
    table[dist] = {n: fp4lab.quant_metrics(t, n) for n in names}

fig, axes = plt.subplots(1, 2, figsize=(12, 4))
width = 0.8 / len(table)
for i, (dist, row) in enumerate(table.items()):
    pos = np.arange(len(names)) + i * width
    axes[0].bar(pos, [float(row[n]["sqnr_db"]) for n in names], width, label=dist)
    axes[1].bar(pos, [100 * float(row[n]["underflow"]) for n in names], width, label=dist)
for ax, title in zip(axes, ["SQNR (dB, higher is better)", "underflow (% of nonzeros)"], strict=True):
    ax.set_xticks(np.arange(len(names)) + 0.4, names, rotation=45, ha="right")
    ax.set_title(title)
axes[0].legend(fontsize=7)
plt.tight_layout(); plt.show()
print("NVFP4 on Gaussian data:", {k: round(float(v), 4) for k, v in table["gaussian"]["nvfp4"].items()})"""),
]

MODEL = [
    ("md", """# 2. Quantize your model

A small transformer written in plain Flax (no fp4lab), a precision policy applied with
`quantize_model`, `explain` to see which recipe each layer gets, and a few training steps of
the quantized model against the same model in BF16, on real text (the standard library's
`json` package, as bytes)."""),
    ("code", """import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd().parent))  # experiments/ runs from the checkout
import jax, jax.numpy as jnp, numpy as np, optax
import flax.linen as nn
import matplotlib.pyplot as plt
from fp4lab.flax import quantize_model
from fp4lab.policy import PrecisionPolicy, Rule, Depth
from experiments.data import load_text"""),
    ("md", "## A model written without fp4lab"),
    ("code", """class Block(nn.Module):
    d: int
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.DenseGeneral((3, self.heads, d // self.heads), name="attn_qkv")(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        x = x + nn.DenseGeneral(d, axis=(-2, -1), name="attn_out")(o)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(d, name="mlp_down")(nn.gelu(nn.Dense(4 * d, name="mlp_up")(h)))


class TinyLM(nn.Module):
    d: int = 64
    depth: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(256, self.d, name="embed")(tokens)
        for i in range(self.depth):
            x = Block(self.d, name=f"blocks_{i}")(x)
        return nn.Dense(256, name="head")(nn.LayerNorm()(x))


model = TinyLM()
text = load_text([Path(json.__file__).parent], val_fraction=0.3)
print(text.describe())
batch = lambda step: jnp.asarray(text.batch(0, step, 16, 64).tokens)
params = model.init(jax.random.key(0), batch(0)[:, :-1])"""),
    ("md", """## A policy, and what it assigns
NVFP4 everywhere, but BF16 for the attention projections and the last block, and MXFP8 for
the MLP down projections: rules are regexes on the module path (first match wins), layer
kinds and depth selectors."""),
    ("code", """policy = PrecisionPolicy(rules=(
    Rule(recipe="bf16", pattern=r".*attn.*", name="attention in BF16"),
    Rule(recipe="bf16", depth=Depth(last=1), name="last block in BF16"),
    Rule(recipe="bf16", pattern="head", name="output head in BF16"),
    Rule(recipe="mxfp8", pattern=r".*mlp_down", name="MLP down in MXFP8"),
), default="nvfp4", name="my policy")
qmodel = quantize_model(model, policy)
print(qmodel.explain(params, batch(0)[:, :-1], strict=True))"""),
    ("md", "## Train both for a few steps"),
    ("code", """def train(apply, steps=40):
    tx = optax.adamw(3e-3)
    p, opt = params, tx.init(params)

    def loss_fn(p, tok, key):
        logits = apply(p, tok[:, :-1], rngs={"quant": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    @jax.jit
    def step(p, opt, tok, key):
        loss, g = jax.value_and_grad(loss_fn)(p, tok, key)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        p, opt, loss = step(p, opt, batch(i), jax.random.key(i))
        losses.append(float(loss))
    return np.array(losses), time.perf_counter() - t0

bf16 = quantize_model(model, "all:bf16")
curves = {"bf16": train(bf16.apply), "my policy": train(qmodel.apply)}
for name, (losses, secs) in curves.items():
    plt.plot(losses, label=f"{name} ({secs:.1f} s)")
plt.xlabel("step"); plt.ylabel("loss (nats/byte)"); plt.legend(); plt.show()
gap = 100 * (curves["my policy"][0][-5:].mean() / curves["bf16"][0][-5:].mean() - 1)
print(f"final-loss gap of the policy to BF16: {gap:+.2f} %")"""),
    ("md", """The same works for Flax NNX models: `quantize_model(nnx_model, policy)` installs the
quantized `dot_general` / `einsum_op` hooks in every `nnx.Linear`, `LinearGeneral` and `Einsum`
in place, keeping the parameters."""),
]

SWEEP = [
    ("md", """# 3. Reading a precision sweep

Loads a sweep's results (the README's default sweep in `results/sweep` if it has been run with
`make sweep`, otherwise a tiny two-policy sweep of a few steps that this notebook runs itself
into a temporary folder), then shows the loss gaps, the layer × GEMM-operand underflow map,
and the auto-assignment recommendation."""),
    ("code", """import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path.cwd().parent))  # experiments/ runs from the checkout
import numpy as np
import matplotlib.pyplot as plt
from experiments.configs import load_config
from experiments.sweep import run_sweep, results_table, layer_order
from experiments.auto_assign import assign_from_summaries
from fp4lab.gemm.recipe import OPERANDS
from fp4lab.policy import explain

def read_results(folder):
    return [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*/result.json"))]

root = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
out = root / "results" / "sweep"
if (out / "results.csv").exists():
    results = read_results(out)
else:  # no sweep yet: a tiny one, trained afresh into a folder removed once read
    with tempfile.TemporaryDirectory(prefix="fp4lab-notebook-sweep-") as tmp:
        out = Path(tmp)
        # 6 steps with probes at steps 0, 3 and 5, no checkpoints: seconds per policy
        run_sweep(load_config("sweep_tiny", ["sweep.policies=('bf16','nvfp4')",
                                             "train.steps=6", "train.log_every=3",
                                             "train.ckpt_every=0", "probes.every=3",
                                             "data.val_batches=1"]),
                  out, progress=False)
        results = read_results(out)
print(f"{len(results)} runs in {out}")"""),
    ("md", "## Loss gaps to BF16 and throughput"),
    ("code", """header, rows = results_table(results)
for row in rows:
    print(dict(zip(header[:7], row[:7], strict=True)))
ok = [r for r in results if r["status"] == "ok" and r["policy"] != "bf16"]
base = next(r for r in results if r["policy"] == "bf16")
gaps = [100 * (r["val_loss"] / base["val_loss"] - 1) for r in ok]
order = np.argsort(gaps)
plt.barh([ok[i]["policy"] for i in order], [gaps[i] for i in order])
plt.xlabel("validation-loss gap to BF16 (%)"); plt.show()"""),
    ("md", """## Where the values flush to zero
Mean underflow per layer and GEMM operand over the probe steps of the all-NVFP4 run (grey:
the operand is not quantized)."""),
    ("code", """run = next(r for r in results if r["policy"] in ("nvfp4", "all:nvfp4"))
summary = run["probe_summary"]
layers = sorted(summary, key=layer_order)
grid = np.array([[summary[l][op]["underflow"] for op in OPERANDS] for l in layers]) * 100
plt.figure(figsize=(6, 0.3 * len(layers) + 1.5))
plt.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="magma_r", vmin=0)
plt.colorbar(label="underflow %")
plt.xticks(range(len(OPERANDS)), OPERANDS, rotation=45, ha="right")
plt.yticks(range(len(layers)), layers)
plt.title(f"{run['policy']}: underflow per layer and operand"); plt.show()"""),
    ("md", """## A recommended policy
The cheapest format per layer whose probed forward operands stay under 10 % underflow and
1e-2 MSE, from the probe summaries of the NVFP4 and MXFP8 runs (the sweep ran them already;
`python -m experiments.auto_assign` runs such probes itself)."""),
    ("code", """by_policy = {r["policy"].removeprefix("all:"): r["probe_summary"] for r in results
             if r["status"] == "ok"}
ladder = [r for r in ("nvfp4", "mxfp8") if r in by_policy] + ["bf16"]
policy, chosen = assign_from_summaries(by_policy, ladder, max_underflow=0.10, max_mse=1e-2,
                                       operands=["fprop_x", "fprop_w"])
for layer, (recipe, why) in chosen.items():
    print(f"{layer:26s} {recipe:6s} {why}")
print(explain(policy, list(chosen)))"""),
]

NOTEBOOKS = {"01_formats.ipynb": FORMATS, "02_quantize_your_model.ipynb": MODEL,
             "03_sweep_analysis.ipynb": SWEEP}


def build(name: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python",
                                  "name": "python3"},
                   "language_info": {"name": "python"}}
    for i, (kind, src) in enumerate(NOTEBOOKS[name]):
        cell = (nbformat.v4.new_markdown_cell(src) if kind == "md"
                else nbformat.v4.new_code_cell(src))
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"  # stable ids: no churn in git
        nb.cells.append(cell)
    return nb


def main():
    for name in NOTEBOOKS:
        nbformat.write(build(name), HERE / name)
        print(f"wrote {HERE / name}")


if __name__ == "__main__" and "pytest" not in sys.modules:
    main()
