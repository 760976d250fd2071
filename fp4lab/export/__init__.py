"""Export quantized weights to the checkpoint formats inference engines load, and read them back.

From a parameter tree (Linen variables or an NNX model) and a policy (or a recipe for every
layer), :func:`quantized_weights` quantizes each linear layer's kernel exactly as its forward
GEMM does: the kernel cast to the layer's compute dtype (by default: as stored), then
``recipe.fprop_w``'s format and tile, in blocks along the kernel's input axis K (a
``DenseGeneral`` kernel's contracting axes, flattened into K, as the GEMM sees it; GGML's
blocks of zero scale hold the bytes of llama.cpp's C quantizer, subnormals included).
:func:`save` writes such tensors in one of four layouts (docs/export.md has every byte), each
a row of :data:`LAYOUT_TABLE` (:class:`Layout`: its writer, its reader, the formats it
takes):

* ``gguf`` (llama.cpp): ``int4_q4_0`` weights as GGML Q4_0, ``int8_q8_0`` as Q8_0,
  ``mxfp4`` (and ``mxfp4_floor``) as GGML MXFP4, ``nvfp4`` as GGML NVFP4 with its per-tensor
  factor in the F32 tensor ``<name>.scale`` (``fl(amax / 2688)``, which llama.cpp multiplies
  into the GEMM's output), through the ``gguf`` package's writer; :mod:`fp4lab.export.ggml`
  has the table of types and their bytes (GGML packs the two halves of a block, or of each
  16-value sub-block for NVFP4, into the low and high nibbles). Kernels are stored ``[out,
  in]`` (GGML's ``ne0`` is K); the rest as F32/F16/BF16. Tensor names are the parameter
  paths with ``.`` for ``/`` and ``weight`` for ``kernel`` (no llama.cpp architecture fits
  fp4lab's models; pass ``names`` to map onto one), and ``fp4lab.tensors`` (JSON) maps them
  back. llama.cpp's dequantization of the bytes is fp4lab's, bit for bit, for Q4_0, Q8_0 and
  MXFP4 (-0 aside: GGML's E2M1 table has none), and within 2 float32 ulps for NVFP4 times its
  ``.scale`` (fp4lab rounds the product of the block scale and the amax first, TE's order).
* ``mxfp4`` (gpt-oss, transformers): safetensors ``<name>_blocks`` (uint8 ``[..., out, in/32,
  16]``, two E2M1 codes per byte, element 2i in the low nibble) and ``<name>_scales`` (uint8
  E8M0 ``[..., out, in/32]``); ``config.json`` holds ``quantization_config``.
* ``nvfp4`` (compressed-tensors, vLLM): ``<module>.weight_packed`` (uint8 ``[out, in/2]``),
  ``<module>.weight_scale`` (float8_e4m3fn ``[out, in/16]``) and ``<module>.weight_global_scale``
  (float32 ``[1]``, ``2688 / amax``, Transformer Engine's encode factor), with the
  ``nvfp4-pack-quantized`` config.
* ``nvfp4_modelopt`` (TensorRT-LLM, ModelOpt): ``<module>.weight`` (uint8), ``weight_scale``
  (float8_e4m3fn), ``weight_scale_2`` (float32, ``amax / 2688``) and, where given, the
  static ``input_scale``; ``hf_quant_config.json``.

What a layout cannot hold is refused, naming the tensor: a weight format it has no type for,
a K that is not a whole number of blocks, a GGUF block whose float16 scale is not finite (a
NaN or infinite weight), an MXFP4 block whose scale is NaN (E8M0 0xFF, which transformers
and llama.cpp read as 2^128), an NVFP4 tensor whose amax is not finite; for GGML's NVFP4
also a K that is not a whole number of 64, a block scale with a sign or NaN (GGML's UE4M3
has neither), a tensor amax whose decode factor overflows, and a weight whose ``.scale``
llama.cpp would not load. 2D weight tiles (NVFP4's 16x16) are written as the 1D groups the
consumers know, each group carrying its tile's scale: the values are the same, and
:func:`load` returns the 1D form. Files are written whole or not
at all (a temporary file renamed), with the ordinary file mode; the optional packages
(``gguf``, ``safetensors``) missing is an error naming the ``export`` extra.

:func:`load` reads any of them back into QArrays (kernels in their ``[in, out]`` layout,
blocks along ``in``) and arrays, keyed by parameter path. It also reads checkpoints made
elsewhere in these layouts (a GGUF file; gpt-oss, compressed-tensors or ModelOpt safetensors,
recognized by their tensor names and keyed by them), so they can be studied with fp4lab's
probes. A truncated or corrupt file is an error naming the file (and the tensor whose bytes
it lacks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np

from fp4lab.export import ggml, modelopt, mxfp4, nvfp4
from fp4lab.export.blocks import tensor_name
from fp4lab.export.safetensors_files import load_safetensors_dir, model_config, read_safetensors
from fp4lab.export.weights import quantized_weights
from fp4lab.policy import get_policy
from fp4lab.numerics.qarray import QArray

__all__ = ["LAYOUTS", "LAYOUT_TABLE", "Layout", "quantized_weights", "save", "export", "load",
           "tensor_name", "read_safetensors"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint layout: ``write(tensors, path, names, metadata, **options)`` writes it
    (``options``: the :func:`save` keywords it takes beyond those), ``read(path)`` reads it
    back, ``formats`` are the fp4lab formats of the quantized weights it holds, ``suffix``
    the name of its one file (``None``: it writes a folder)."""

    name: str
    write: Callable[..., None]
    read: Callable[[Path], dict]
    formats: tuple[str, ...]
    suffix: str | None = None
    options: tuple[str, ...] = ()

    def recognizes(self, path: Path) -> bool:
        """Whether ``path`` is what this layout reads (the safetensors layouts share one
        reader, which tells them apart by their tensor names)."""
        return path.is_file() and path.suffix == self.suffix if self.suffix else path.is_dir()


LAYOUT_TABLE = {lay.name: lay for lay in (
    Layout("gguf", ggml.save_gguf, ggml.load_gguf, ggml.FORMATS, ".gguf", ("arch",)),
    Layout("mxfp4", mxfp4.save_mxfp4, load_safetensors_dir, mxfp4.FORMATS),
    Layout("nvfp4", nvfp4.save_nvfp4, load_safetensors_dir, nvfp4.FORMATS),
    Layout("nvfp4_modelopt", modelopt.save_modelopt, load_safetensors_dir, modelopt.FORMATS,
           options=("input_amax",)),
)}
LAYOUTS = tuple(LAYOUT_TABLE)


def _layout(layout: str) -> Layout:
    if layout not in LAYOUT_TABLE:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUT_TABLE[layout]


def _out_path(path, layout: str) -> Path:
    """``path`` as a Path, refused unless it can be what ``layout`` writes: a file named
    ``*<suffix>`` that is not a folder, or a folder that is not a file, under no file."""
    lay, path = _layout(layout), Path(path)
    if lay.suffix and (path.is_dir() or path.suffix != lay.suffix):
        raise ValueError(f"output path {str(path)!r}: the {lay.name} layout writes one file "
                         f"whose name ends in {lay.suffix}" + (", and this is a folder"
                                                               if path.is_dir() else ""))
    if not lay.suffix and path.exists() and not path.is_dir():
        raise ValueError(f"output path {str(path)!r} is a file; the {lay.name} layout writes "
                         "a folder (model.safetensors, config.json)")
    above = next(p for p in path.parents if p.exists())
    if not above.is_dir():
        raise ValueError(f"output path {str(path)!r} lies under the file {str(above)!r}")
    return path


def _check_tensors(tensors: Mapping, lay: Layout, names: Callable[[str], str]) -> None:
    """Before anything is written: one tensor a name, and every quantized weight in a
    format the layout holds."""
    seen: dict[str, str] = {}
    for p, value in tensors.items():
        n = names(p)
        if n in seen:
            raise ValueError(f"tensor name {n!r} for both {seen[n]!r} and {p!r}")
        seen[n] = p
        for q in value if isinstance(value, tuple) else (value,):  # an expert stack's each
            if isinstance(q, QArray) and q.format.name not in lay.formats:
                raise ValueError(f"{p}: format {q.format.name!r} has no {lay.name} type; "
                                 f"the {lay.name} layout takes {', '.join(lay.formats)} or "
                                 "a pass-through dtype")


def save(tensors: Mapping[str, QArray | tuple[QArray, ...] | jax.Array | np.ndarray], path,
         layout: str, *,
         names: Callable[[str], str] | None = None, metadata: Mapping | None = None,
         input_amax: Mapping[str, float] | None = None, arch: str = "fp4lab") -> Path:
    """Write ``tensors`` (``{parameter path: QArray or array}``, as :func:`quantized_weights`
    returns; an expert stack's tuple of QArrays in ``gguf``, one tensor with a leading
    experts axis) to ``path`` in ``layout`` (:data:`LAYOUTS`): a ``.gguf`` file for ``gguf``, a
    folder (``model.safetensors``, ``config.json``) for the others. ``names`` maps a path to
    its tensor name (default :func:`tensor_name`); ``metadata`` is stored alongside (GGUF:
    keys of the architecture, ``general.*`` and ``tokenizer.*`` as given, with their values'
    GGUF types, e.g. ``{"llama.block_count": 2}`` a uint32; any other key as the string
    ``fp4lab.<key>``; ``general.file_type`` from the weights; the others: ``config.json``'s
    ``fp4lab`` section);
    ``input_amax`` gives NVFP4 layers their static activation amax (ModelOpt's
    ``input_scale = amax / 2688``); ``arch``: GGUF's ``general.architecture``."""
    lay = _layout(layout)
    if input_amax and "input_amax" not in lay.options:
        raise ValueError(f"input_amax is ModelOpt's input_scale; layout {layout!r} has none")
    names = names or tensor_name
    _check_tensors(tensors, lay, names)
    path = _out_path(path, layout)
    if not lay.suffix:
        model_config(path)  # a config.json the export must extend but cannot: refused now
    given = {"input_amax": input_amax, "arch": arch}
    lay.write(tensors, path, names, metadata, **{k: given[k] for k in lay.options})
    return path


def export(params, how, path, layout: str, *, layers: Mapping[str, str | None] | None = None,
           compute_dtype=None, num_blocks: int | None = None,
           contracting: Mapping[str, int] | None = None,
           experts: Mapping[str, str] | None = None, **save_kw) -> Path:
    """:func:`quantized_weights` of ``params`` as ``how`` says (the model's record or a
    policy; ``layers``: their kinds), written by :func:`save`; the policy is recorded in the
    metadata."""
    from fp4lab.policy import ExplainTable, explain, policy_to_dict

    _out_path(path, layout)  # a wrong path fails before the work
    weights = quantized_weights(params, how, layers=layers, compute_dtype=compute_dtype,
                                num_blocks=num_blocks, contracting=contracting,
                                experts=experts)
    policy = how.policy if isinstance(how, ExplainTable) else get_policy(how)
    try:
        recorded = policy_to_dict(policy)
    except ValueError:  # a recipe outside the registry: its layers' assignment, as text
        recorded = {"name": policy.name, "explain": str(explain(
            policy, [p.rpartition("/")[0] for p in weights if p.endswith("/kernel")]))}
    meta = {"policy": recorded, **(save_kw.pop("metadata", None) or {})}
    return save(weights, path, layout, metadata=meta, **save_kw)


def load(path) -> dict[str, QArray | np.ndarray]:
    """A checkpoint in one of the layouts: QArrays for the quantized kernels (``[in, out]``,
    blocks along ``in``), arrays for the rest. Written by :func:`save`, it is keyed by
    parameter path. Made elsewhere (a ``.gguf`` file, or a folder of ``.safetensors`` files,
    shards included, from gpt-oss, compressed-tensors or ModelOpt), it is keyed by tensor
    name (the module's name for an NVFP4 weight, ``X`` for gpt-oss's ``X_blocks``) and the
    layout is recognized from the names; an NVFP4 QArray's amax is then ``2688 /
    weight_global_scale`` (or ``2688 * weight_scale_2``, or ``2688 * <name>.scale`` in
    GGUF), so its dequantization follows Transformer Engine's order, within an ulp or two of
    the consumer's (docs/export.md)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    for lay in LAYOUT_TABLE.values():
        if lay.recognizes(path):
            return lay.read(path)
    raise ValueError(f"{str(path)!r}: a checkpoint is a .gguf file or a folder of "
                     ".safetensors files")
