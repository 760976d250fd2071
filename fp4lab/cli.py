"""The ``fp4lab`` command line.

    fp4lab formats                     table of every format (bits, range, block, scale, cost)
    fp4lab export PARAMS --policy P --layout L --out PATH [--compute-dtype stored]
                                       quantized weights as a GGUF / MXFP4 / NVFP4 checkpoint
    fp4lab compare [--tensor F.npy]    SQNR / underflow / saturation / scale health of every
                                       format on several distributions (and your tensors)
                   [--plot out.png|.jpg|.pdf|.svg] [--formats nvfp4,mxfp8] [--size 262144]
                   [--dtype bf16] [--axis -1]

``fp4lab export`` reads the parameters from an ``.npz`` or ``.safetensors`` file whose keys
are parameter paths (``blocks_0/mlp/up/kernel``; Flax:
``{"/".join(k): v for k, v in flax.traverse_util.flatten_dict(params).items()}``) and
quantizes every linear layer's kernel as the policy's forward pass does
(``fp4lab.export``, docs/export.md): by default the kernel as stored, as a layer without
``dtype=`` computes; ``--compute-dtype bfloat16`` for layers that cast it (``Dense(dtype=
jnp.bfloat16)``).

Your tensors are quantized in their own dtype (float32, bfloat16, float16; float64 is read
as float32); the synthetic distributions in ``--dtype`` (BF16 by default, as training
tensors are). A BF16 ``.npy`` saved from JAX (NumPy records its dtype as ``|V2``) is read
as BF16.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import numpy as np

from fp4lab.files import atomic

__all__ = ["main", "format_rows", "DISTRIBUTIONS", "load_tensors", "load_params", "compare"]


def _fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    e = math.log2(abs(v))
    if e == int(e) and abs(e) >= 4:
        return f"2^{int(e)}"
    return f"{v:.6g}"


def format_rows() -> list[dict[str, str]]:
    """One row per registered format, for ``fp4lab formats``."""
    from fp4lab.numerics.formats import FORMATS

    rows = []
    for f in FORMATS.values():
        el = f.element
        scale = {"none": "-", "tensor": "fp32/tensor"}.get(f.granularity)
        if scale is None:
            unit = f"{f.block}" if f.granularity == "block" else "channel"
            scale = f"{f.scaling.storage.name}/{unit}"
        if f.has_global_scale:
            per = {"slice": "row"}.get(f.scaling.outer_amax, f.scaling.outer_amax)
            scale += f" + fp32/{per}"
        rows.append({
            "format": f.name,
            "element": el.name,
            "bits": str(el.bits),
            "max": _fmt_num(el.max),
            "min normal": _fmt_num(el.min_normal),
            "min subnormal": _fmt_num(el.min_subnormal),
            "block": {"block": str(f.block), "channel": "axis", "tensor": "tensor"}.get(
                f.granularity, "-"),
            "scale": scale,
            "bits/elem": (f"{f.bits_per_element():.3g}" if f.granularity != "channel"
                          else f"{el.bits}+32/K"),
            "follows": f.follows,
        })
    return rows


def _table(rows: list[dict[str, str]]) -> str:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = lambda r: "| " + " | ".join(r[c].ljust(width[c]) for c in cols) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (width[c] + 2) for c in cols) + "|"
    return "\n".join([line({c: c for c in cols}), sep] + [line(r) for r in rows])


# ----------------------------------------------------------------------------- compare


def _student_t(rng, n):
    return rng.standard_t(3.0, n)


def _outlier_channels(rng, n):
    """Activations with a few large channels (LLM-style outlier features), 1024 columns."""
    x = rng.standard_normal(n).reshape(-1, 1024)
    x[:, rng.choice(1024, 8, replace=False)] *= 50
    return x.reshape(-1)


DISTRIBUTIONS: dict[str, Callable] = {
    "gaussian": lambda rng, n: rng.standard_normal(n),
    "student-t(3)": _student_t,
    "log-normal": lambda rng, n: rng.choice([-1, 1], n) * rng.lognormal(0.0, 2.0, n),
    "outlier-channels": _outlier_channels,
    "gradient-like": lambda rng, n: rng.standard_normal(n) * 1e-6 * rng.lognormal(0, 1.5, n),
}


def load_tensors(path: str) -> dict[str, np.ndarray]:
    """Tensors from ``.npy`` / ``.npz`` (every array, or ``file.npz:name``)."""
    name = None
    if ":" in path and not os.path.exists(path):
        path, name = path.rsplit(":", 1)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tensor file {path!r} does not exist")
    base = os.path.basename(path)
    if path.endswith(".npy"):
        return {base: _known_dtype(_read_npy(path), base)}
    if path.endswith(".npz"):
        arrays = _read_npz(path, name)
        return {f"{base}:{k}": _known_dtype(x, f"{base}:{k}") for k, x in arrays.items()}
    raise ValueError(f"unsupported tensor file {path!r}: use .npy or .npz")


_NPZ = "a valid .npz file (a zip archive of .npy arrays, as numpy.savez writes)"
_NPY = "a valid .npy file (one array, as numpy.save writes)"
_NPY_MAGIC = b"\x93NUMPY"


def _not_zip(path: str) -> str:
    """Why ``path``, named ``.npz``, is no zip archive: what its first bytes say it is."""
    with open(path, "rb") as f:
        head = f.read(len(_NPY_MAGIC))
    if not head:
        return "it is empty (0 bytes)"
    if head == _NPY_MAGIC:
        return "it holds a single .npy array, not named arrays"
    if head.startswith(b"PK"):
        return "it begins as a zip archive but is cut short or damaged (no zip directory)"
    return f"it is not a zip archive ({os.path.getsize(path)} bytes of something else)"


def _read_npz(path: str, name: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path`` (every one, or ``name``). A file that is not
    one (cut short, empty, another format under the name) is a ValueError naming it, where
    NumPy and zipfile would raise ``BadZipFile``, ``EOFError`` or a word about pickles."""
    import zipfile
    import zlib

    if not zipfile.is_zipfile(path):  # what np.load would try next is unpickling it
        raise ValueError(f"{path!r} is not {_NPZ}: {_not_zip(path)}")
    try:
        with np.load(path) as z:
            keys = [name] if name else list(z.keys())
            missing = [k for k in keys if k not in z]
            if missing:
                raise KeyError(f"{missing[0]!r} not in {path}; it holds {sorted(z.keys())}")
            return {k: z[k] for k in keys}
    except (zipfile.BadZipFile, EOFError, zlib.error, ValueError) as e:  # a damaged member
        raise ValueError(f"{path!r} is not {_NPZ}: {e}") from None


def _read_npy(path: str) -> np.ndarray:
    """The array of the ``.npy`` file ``path``; one that is not (see :func:`_read_npz`) is a
    ValueError naming it."""
    try:
        x = np.load(path)
    except (EOFError, ValueError) as e:
        raise ValueError(f"{path!r} is not {_NPY}: {e}") from None
    if not isinstance(x, np.ndarray):  # np.load opened a zip archive
        x.close()
        raise ValueError(f"{path!r} is not {_NPY}: it is a zip archive (.npz); name it .npz")
    return x


def _known_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """NumPy stores ml_dtypes arrays as raw bytes (``|V2`` for bfloat16): read 2-byte raw
    elements as bfloat16; 1-byte ones are ambiguous (which FP8?) and refused."""
    if x.dtype.kind == "V" and x.dtype.itemsize == 2 and not x.dtype.names:
        import ml_dtypes

        return x.view(ml_dtypes.bfloat16)
    if x.dtype.kind == "V":
        raise TypeError(f"{name}: raw {x.dtype.itemsize}-byte elements (dtype {x.dtype}) do not "
                        "say their number format; save the tensor as float32 or bfloat16")
    return x


def _as_matrix(x: np.ndarray, axis: int) -> np.ndarray:
    """2D, blocks along the last axis, in the tensor's own float dtype (float64: float32)."""
    import ml_dtypes

    if not (np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16):
        raise TypeError(f"tensor of dtype {x.dtype} is not floating point")
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    x = np.moveaxis(x, axis, -1) if x.ndim else x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def compare(tensors: dict[str, np.ndarray], formats: list[str]) -> list[dict]:
    """Metrics of every format on every tensor (2D, blocks along the last axis), one dict per
    (tensor, format)."""
    import jax.numpy as jnp

    from fp4lab.numerics.formats import get_format
    from fp4lab.numerics.metrics import quant_metrics

    out = []
    for tname, x in tensors.items():
        xj = jnp.asarray(x)  # quantized in its own dtype
        for f in formats:
            m = {k: float(v) for k, v in quant_metrics(xj, f).items()}
            out.append({"tensor": tname, "format": get_format(f).name,
                        "bits/elem": get_format(f).bits_per_element(x.shape[-1]), **m})
    return out


def _plot(results: list[dict], path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    tensors = list(dict.fromkeys(r["tensor"] for r in results))
    formats = list(dict.fromkeys(r["format"] for r in results))
    get = {(r["tensor"], r["format"]): r for r in results}
    fig = Figure(figsize=(18, 5.5))
    axes = fig.subplots(1, 3)
    width = 0.8 / len(tensors)
    xs = np.arange(len(formats))
    panels = [("sqnr_db", "SQNR (dB, higher is better)", 1.0),
              ("underflow", "underflow: nonzero -> 0 (%)", 100.0),
              ("saturation", "saturation (%)", 100.0)]
    for ax, (key, title, mult) in zip(axes, panels, strict=True):
        for i, t in enumerate(tensors):
            vals = np.array([get[(t, f)][key] * mult for f in formats])
            pos = xs + i * width - 0.4 + width / 2
            ax.bar(pos, np.where(np.isfinite(vals), vals, 0.0), width, label=t)
            for p_, v in zip(pos, vals, strict=True):
                if np.isposinf(v):  # lossless (e.g. BF16 input in BF16): no finite bar
                    ax.text(p_, 0, "exact", rotation=90, fontsize=6, ha="center", va="bottom")
        ax.set_xticks(xs, formats, rotation=60, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("fp4lab compare: every format on every tensor (blocks on the last axis)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kind = plot_format(path)
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=110, format=kind)


def plot_format(path: str) -> str:
    """The image format a plot path asks for (its suffix), if matplotlib can write it."""
    from matplotlib.figure import Figure

    kind = os.path.splitext(path)[1].lstrip(".").lower()
    known = Figure().canvas.get_supported_filetypes()
    if kind not in known:
        raise ValueError(f"--plot {path!r}: the suffix says {kind or 'no'} format; use one of "
                         f"{', '.join('.' + k for k in sorted(known))}")
    return kind


def _cmd_formats(args) -> int:
    print(_table(format_rows()))
    return 0


def _cmd_compare(args) -> int:
    from fp4lab.numerics.formats import FORMATS, get_format

    formats = ([get_format(f).name for f in args.formats.split(",")] if args.formats
               else [n for n, f in FORMATS.items() if n not in ("fp32", "fp16")])
    if args.plot:
        plot_format(args.plot)  # a bad suffix fails before the work, not after
    import ml_dtypes

    synthetic = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp16": np.float16}[args.dtype]
    rng = np.random.default_rng(args.seed)
    tensors = {}
    if not args.only_files:
        for name, gen in DISTRIBUTIONS.items():
            tensors[name] = gen(rng, args.size).astype(np.float32).astype(synthetic).reshape(
                -1, 1024)
    for path in args.tensor or []:
        for name, x in load_tensors(path).items():
            tensors[name] = _as_matrix(x, args.axis)
    if not tensors:
        raise SystemExit("nothing to compare: give --tensor FILE or drop --only-files")
    results = compare(tensors, formats)
    for tname in tensors:
        rows = [{"format": r["format"], "bits/elem": f"{r['bits/elem']:.3g}",
                 "SQNR dB": f"{r['sqnr_db']:.2f}", "underflow %": f"{100 * r['underflow']:.3f}",
                 "saturation %": f"{100 * r['saturation']:.3f}",
                 "bad scales %": f"{100 * r['bad_scales']:.2f}"}
                for r in results if r["tensor"] == tname]
        shape = "x".join(map(str, tensors[tname].shape))
        print(f"\n## {tname} ({shape}, {tensors[tname].dtype})\n")
        print(_table(rows))
    print("\nunderflow: fraction of nonzero inputs that dequantize to 0; saturation: inputs "
          "clipped at the element range;\nbad scales: blocks whose scale is zero/subnormal "
          "(E8M0: clamped at 2^-127).")
    if args.plot:
        _plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def load_params(path: str) -> dict:
    """A parameter tree from an ``.npz`` or ``.safetensors`` file keyed by ``/``-joined
    parameter paths."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"parameter file {path!r} does not exist")
    if path.endswith(".safetensors"):
        from fp4lab.export import read_safetensors

        flat = read_safetensors(path)[0]
    elif path.endswith(".npz"):
        flat = {k: _known_dtype(x, k) for k, x in _read_npz(path).items()}
    else:
        raise ValueError(f"unsupported parameter file {path!r}: use .npz or .safetensors")
    tree: dict = {}
    for key, value in flat.items():
        node, parts = tree, key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{path}: {key!r} lies under another parameter's path")
        node[parts[-1]] = value
    return tree


def _cmd_export(args) -> int:
    from fp4lab import export

    dtype = None if args.compute_dtype == "stored" else args.compute_dtype
    out = export.export(load_params(args.params), args.policy, args.out, args.layout,
                        compute_dtype=dtype)
    print(f"wrote {out} ({args.layout}, policy {args.policy})")
    print("  its tensors under fp4lab's names, with no model architecture: no engine runs this "
          "file as a model (fp4lab.export.load and the engines' tensor readers read it; "
          "experiments.export writes the hybrid LM as llama.cpp's nemotron_h and "
          "transformers' NemotronHForCausalLM)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fp4lab", description="Low-precision numerics toolkit.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("formats", help="table of every format").set_defaults(fn=_cmd_formats)
    c = sub.add_parser("compare", help="error/underflow/saturation of every format")
    c.add_argument("--tensor", action="append", metavar="FILE",
                   help=".npy or .npz (or file.npz:name) to include; repeatable")
    c.add_argument("--axis", type=int, default=-1, help="block axis of --tensor arrays")
    c.add_argument("--formats", default="", help="comma-separated format names (default: all)")
    c.add_argument("--size", type=int, default=262144,
                   help="elements per synthetic tensor, a multiple of 1024 (the synthetic "
                        "tensors are 1024 wide; default: 262144)")
    c.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16",
                   help="dtype of the synthetic tensors (yours keep their own; default: bf16)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--only-files", action="store_true", help="skip synthetic distributions")
    c.add_argument("--plot", metavar="FILE.png", help="write a bar chart (the suffix picks the "
                   "format: .png, .jpg, .pdf, .svg, ...)")
    c.set_defaults(fn=_cmd_compare)
    from fp4lab.export import LAYOUTS

    e = sub.add_parser("export", help="quantized weights as a checkpoint an inference engine "
                       "loads (GGUF, MXFP4, NVFP4)")
    e.add_argument("params", help=".npz or .safetensors keyed by parameter paths")
    e.add_argument("--policy", required=True, help="a recipe for every layer (q4_0_qat, "
                   "mxfp4_weights, nvfp4, ...), a preset, all:<recipe> or file:<policy.json>")
    e.add_argument("--layout", required=True, choices=LAYOUTS)
    e.add_argument("--out", required=True, help="a .gguf file, or a folder for the others")
    e.add_argument("--compute-dtype", default="stored",
                   choices=("stored", "bfloat16", "float16", "float32"),
                   help="the dtype the layers cast their kernels to before the GEMM, which "
                        "the forward quantizes (default: stored, the kernel as stored, as a "
                        "layer without dtype= computes; bfloat16 for Dense(dtype=bfloat16))")
    e.set_defaults(fn=_cmd_export)
    args = p.parse_args(argv)
    if getattr(args, "size", 1024) % 1024 or getattr(args, "size", 1024) <= 0:
        p.error(f"--size={args.size} must be a positive multiple of 1024")
    try:
        return args.fn(args)
    except (ValueError, TypeError, KeyError, OSError, ImportError) as e:
        print(f"fp4lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
