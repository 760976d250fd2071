"""The hybrid LM as an inference engine's own architecture: llama.cpp's ``nemotron_h``.

``experiments.model.HybridLM`` is Nemotron-H's block structure (pre-norm ``x +
mixer(rmsnorm(x))``, one mixer per block: ``M`` Mamba-2, ``*`` attention without RoPE, ``-``
squared-ReLU MLP; a final RMSNorm and an untied head), so llama.cpp runs it as the
architecture ``nemotron_h`` (its ``src/models/nemotron-h.cpp``) once the tensors carry that
architecture's names and shapes and the file its keys, as llama.cpp's own converter
(``convert_hf_to_gguf.py``, class ``NemotronHModel`` and its Mamba-2 parents) writes them:

=====================================  ======================================================
fp4lab parameter                       GGUF tensor (shapes in NumPy order, ``[out, in]``)
=====================================  ======================================================
``embed/embedding`` ``[V, D]``         ``token_embd.weight`` ``[V, D]``
``blocks_i/norm/scale``                ``blk.i.attn_norm.weight`` (every block's pre-norm)
``blocks_i/mamba/in_proj/kernel``      ``blk.i.ssm_in.weight`` ``[2E + 2N + H, D]`` (z, xBC, dt)
``blocks_i/mamba/conv_kernel`` [W, C]  ``blk.i.ssm_conv1d.weight`` ``[C, W]`` (HF's
                                       ``conv1d.weight [C, 1, W]`` squeezed)
``blocks_i/mamba/conv_bias``           ``blk.i.ssm_conv1d.bias``
``blocks_i/mamba/dt_bias``             ``blk.i.ssm_dt.bias`` ``[H]``
``blocks_i/mamba/A_log``               ``blk.i.ssm_a`` ``[H, 1]`` = ``-exp(A_log)``
``blocks_i/mamba/D``                   ``blk.i.ssm_d`` ``[H, 1]``
``blocks_i/mamba/norm/scale``          ``blk.i.ssm_norm.weight`` ``[groups, E / groups]``
``blocks_i/mamba/out_proj/kernel``     ``blk.i.ssm_out.weight``
``blocks_i/attention/qkv/kernel``      ``blk.i.attn_q`` / ``attn_k`` / ``attn_v.weight``: the
                                       fused kernel's output columns split in three (the
                                       quantization blocks run along the input axis, so each
                                       part keeps its blocks and bytes)
``blocks_i/attention/out/kernel``      ``blk.i.attn_output.weight``
``blocks_i/mlp/{up,down}/kernel``      ``blk.i.ffn_up.weight`` / ``blk.i.ffn_down.weight``
``blocks_i/moe/router/kernel``         ``blk.i.ffn_gate_inp.weight`` ``[E, D]``, float32
``blocks_i/moe/router_bias``           ``blk.i.exp_probs_b.bias`` ``[E]`` (zeros without one)
``blocks_i/moe/experts/{up,down}``     ``blk.i.ffn_up_exps`` / ``ffn_down_exps.weight``
                                       ``[E, out, in]``, each expert's blocks stacked (NVFP4:
                                       a ``.scale`` ``[E]``, one per expert)
``blocks_i/moe/latent_{down,up}``      ``blk.i.ffn_latent_down`` / ``ffn_latent_up.weight``
``blocks_i/moe/shared_expert/...``     ``blk.i.ffn_up_shexp`` / ``ffn_down_shexp.weight``
                                       (required: an F32 all-zero one of width 16 without)
``final_norm/scale``                   ``output_norm.weight``
``head/kernel``                        ``output.weight``
=====================================  ======================================================

A model with MoE blocks is llama.cpp's ``nemotron_h_moe`` (the same loader and graph, which
its converter names so for a Nemotron-H with experts), with the expert keys of
:func:`_moe_metadata`. llama.cpp routes as ``experiments.moe.route``'s sigmoid: scores
``sigmoid(router)``, the top-k of the scores plus the bias, weights the chosen (unbiased)
scores normalized; the router and the shared expert see the block's full width, the experts
the latent one.

Each block's kind is read by llama.cpp from two per-layer arrays: ``feed_forward_length``
(``F`` for an MLP block, the experts' width for an MoE block, else 0) and ``attention.head_count_kv`` (the heads for an attention
block, else 0); a block with both 0 is a Mamba-2 block.

Details llama.cpp fixes, checked against the model (nothing needed a new model option):

* one RMSNorm epsilon for every norm (``attention.layer_norm_rms_epsilon``): the model's
  norms all use 1e-6, written as such (Nemotron-H's own checkpoints use 1e-5);
* the gated norm ``rmsnorm(y * silu(z))`` over groups of ``E / ssm.group_count`` channels:
  the model normalizes over all ``E`` channels with one B and C, so ``group_count = 1``;
* the time step ``softplus(dt + dt_bias)`` with no clamp (HF's ``time_step_limit`` is
  ``(0, inf)``); GGML's softplus returns ``x`` above 20, where float32 ``log1p(exp(x))`` is
  ``x`` as well;
* attention scale ``1/sqrt(head_dim)`` (``attention.scale`` unset), no RoPE, no biases in
  any GEMM (llama.cpp's are optional), the convolution's bias present;
* the untied head (``output.weight``).

Left out: the multi-token-prediction head (``mtp_*``). llama.cpp's ``nemotron_h`` runs the
main head only (its MTP blocks are Nemotron 3's MoE NextN layers, a different structure),
so a run trained with ``mtp=True`` is served without it; :func:`notes` says so.

Refused (:func:`check_nemotron_h`, naming the options): those whose forward pass llama.cpp
cannot compute, the same as transformers' NemotronH cannot (``experiments.hf_nemotron_h``'s
table ``UNSUPPORTED``): ``residual_gate`` (a gated residual write), ``residual_format``
(the residual stream stored in FP8), ``ssm_state_format`` other than ``fp32`` (the Mamba
state stored in a low precision) and flash attention with ``attention_accumulate`` below
FP32, the MoE options NemotronH cannot route (a softmax router, fewer than 2 experts, a
router below float32, ``moe_dispatch``); and the patterns llama.cpp cannot hold: MLP blocks
beside MoE blocks (once a file has experts, every feed-forward block loads as an MoE block)
and a pattern without a Mamba block or without an attention block (llama.cpp's hybrid memory
aborts at the first decode). Backward-only options (``attention_saved``, ``mlp_saved``) pass.

The vocabulary (:func:`tokenizer_metadata`): the byte vocabulary as GPT-2's byte-level BPE
(token ``b`` is byte ``b`` in GPT-2's byte-to-unicode alphabet), a ``tokenizers`` BPE
trained by ``experiments.tokenize`` as itself (its tokens and merges), padded to the
model's vocabulary with ``[PAD<i>]`` tokens as the converter pads; token ids from elsewhere
(a nanoGPT ``meta.pkl``, ``data.vocab_size``) as llama.cpp's ``none`` vocabulary of
``vocab_size`` tokens. No ``tokenizer.ggml.token_type`` is written (llama.cpp takes it only
as an INT32 array, and ``fp4lab.export`` writes non-negative integer arrays as UINT32), so
every token is a normal one: ``<|endoftext|>`` (id 0, also the BOS and EOS ids) is not
marked as a control token, and llama.cpp tokenizes that text as its bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fp4lab.numerics.qarray import QArray

__all__ = ["ARCH", "MOE_ARCH", "arch_of", "check_nemotron_h", "split_columns", "nemotron_h_tensors",
           "nemotron_h_metadata", "tokenizer_metadata", "notes"]

ARCH = "nemotron_h"
MOE_ARCH = "nemotron_h_moe"
RMS_EPS = 1e-6  # experiments.model.RMSNorm's, every norm of the model
# a merge whose two symbols GPT-2's pre-tokenizer never leaves side by side (letters and
# digits are separate pieces): llama.cpp's BPE needs a merges list, a byte vocabulary has none
_NO_MERGE = "a 0"


def arch_of(cfg) -> str:
    """The llama.cpp architecture of ``cfg``: ``nemotron_h_moe`` with MoE blocks (what
    llama.cpp's converter writes for a Nemotron-H with experts), else :data:`ARCH`."""
    return MOE_ARCH if "E" in cfg.pattern else ARCH


def check_nemotron_h(cfg) -> None:
    """ValueError naming every option of ``cfg`` (a ModelConfig) whose forward pass
    llama.cpp's ``nemotron_h`` (``nemotron_h_moe``) does not compute: those transformers'
    NemotronH cannot either (one table, ``experiments.hf_nemotron_h.UNSUPPORTED``) and the
    patterns llama.cpp cannot hold, all of them at once."""
    from experiments.hf_nemotron_h import refused_options

    bad = refused_options(cfg)
    if "E" in cfg.pattern and "-" in cfg.pattern:
        bad.append(f"pattern={cfg.pattern!r} (MLP blocks beside MoE blocks: once a file has "
                   "experts, llama.cpp loads every feed-forward block as an MoE block)")
    if "M" not in cfg.pattern or "*" not in cfg.pattern:
        bad.append(f"pattern={cfg.pattern!r} (no Mamba or no attention block: llama.cpp's "
                   "hybrid memory aborts at the first decode without both)")
    if bad:
        raise ValueError(f"llama.cpp's {arch_of(cfg)} cannot run this model: " + "; ".join(bad)
                         + ". Export its tensors under the generic architecture instead "
                         "(--gguf-arch fp4lab), which no engine runs as a model")


def split_columns(value, sizes: list[int]) -> list:
    """A kernel ``[in, out]`` (a QArray with blocks along ``in`` or 2D tiles, or an array)
    split along ``out`` into parts of ``sizes`` columns; a QArray's codes and scales are
    split with it, unchanged (a tiled one at tile boundaries)."""
    if sum(sizes) != value.shape[-1]:
        raise ValueError(f"sizes {sizes} do not add up to the {value.shape[-1]} columns of a "
                         f"kernel of shape {tuple(value.shape)}")
    edges = list(zip(np.cumsum([0, *sizes])[:-1].tolist(), np.cumsum(sizes).tolist(), strict=True))
    if not isinstance(value, QArray):
        return [value[..., a:b] for a, b in edges]
    if value.tile is None:
        if value.axis % len(value.shape) != len(value.shape) - 2:
            raise ValueError(f"{value}: blocks along the output axis; a split along it would "
                             "cut them")
        return [_part(value, value.data[..., a:b], value.scale[..., a:b], b - a)
                for a, b in edges]
    t = value.tile[-1]
    if any(n % t for n in sizes):
        raise ValueError(f"{value}: parts of {sizes} columns cut its {value.tile} tiles")
    per_byte = value.shape[-1] // value.data.shape[-1]  # codes packed along the last axis
    return [_part(value, value.data[..., a // per_byte:b // per_byte],
                  value.scale[..., a // t:b // t], b - a) for a, b in edges]


def _part(q: QArray, data, scale, columns: int) -> QArray:
    return QArray(data, scale, q.global_scale, q.format, q.axis, q.tile,
                  (*q.shape[:-1], int(columns)))


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def _mamba(p: str, w: dict, i: int, groups: int) -> dict:
    a = -np.exp(_f32(w[f"{p}/A_log"]))
    norm = _f32(w[f"{p}/norm/scale"])
    return {f"{p}/in_proj/kernel": (f"blk.{i}.ssm_in.weight", w[f"{p}/in_proj/kernel"]),
            f"{p}/conv1d": (f"blk.{i}.ssm_conv1d.weight", _f32(w[f"{p}/conv_kernel"]).T),
            f"{p}/conv_bias": (f"blk.{i}.ssm_conv1d.bias", _f32(w[f"{p}/conv_bias"])),
            f"{p}/dt_bias": (f"blk.{i}.ssm_dt.bias", _f32(w[f"{p}/dt_bias"])),
            f"{p}/A": (f"blk.{i}.ssm_a", a[:, None]),
            f"{p}/D": (f"blk.{i}.ssm_d", _f32(w[f"{p}/D"])[:, None]),
            f"{p}/norm/scale": (f"blk.{i}.ssm_norm.weight", norm.reshape(groups, -1)),
            f"{p}/out_proj/kernel": (f"blk.{i}.ssm_out.weight", w[f"{p}/out_proj/kernel"])}


def _attention(p: str, w: dict, i: int) -> dict:
    qkv = w[f"{p}/qkv/kernel"]
    d = qkv.shape[-1] // 3
    parts = split_columns(qkv, [d, d, d])
    out = {f"{p}/qkv/{x}/kernel": (f"blk.{i}.attn_{x}.weight", part)
           for x, part in zip("qkv", parts, strict=True)}
    out[f"{p}/out/kernel"] = (f"blk.{i}.attn_output.weight", w[f"{p}/out/kernel"])
    return out


def _mlp(p: str, w: dict, i: int) -> dict:
    return {f"{p}/{x}/kernel": (f"blk.{i}.ffn_{x}.weight", w[f"{p}/{x}/kernel"])
            for x in ("up", "down")}


def _moe(p: str, w: dict, i: int, cfg) -> dict:
    """An MoE block as llama.cpp's: the router float32 (as its converter writes it; fp4lab's
    is float32 unless a rule quantizes it, refused here), the routing bias (zeros without
    one), each expert stack ``[E, in, out]`` as ``[E, out, in]`` (a tuple of per-expert
    QArrays: their blocks stacked), the latent projections, the shared expert (an all-zero
    one of ``ZERO_SHARED`` where the block has none: llama.cpp requires it)."""
    from experiments.hf_nemotron_h import moe_stand_ins

    w = {**moe_stand_ins(cfg, p), **{k: v for k, v in w.items() if k.startswith(p + "/")}}
    router = w[f"{p}/router/kernel"]
    if isinstance(router, QArray):
        raise ValueError(f"{p}/router/kernel: quantized as {router.format.name}; llama.cpp "
                         "computes the router from a float32 ffn_gate_inp (keep routers out "
                         "of the policy's quantized layers)")
    out = {f"{p}/router/kernel": (f"blk.{i}.ffn_gate_inp.weight", _f32(router)),
           f"{p}/router_bias": (f"blk.{i}.exp_probs_b.bias", _f32(w[f"{p}/router_bias"]))}
    for x in ("up", "down"):
        out[f"{p}/experts/{x}/kernel"] = (f"blk.{i}.ffn_{x}_exps.weight", w[f"{p}/experts/{x}"])
        out[f"{p}/shared_expert/{x}/kernel"] = (f"blk.{i}.ffn_{x}_shexp.weight",
                                                w[f"{p}/shared_expert/{x}/kernel"])
        if cfg.moe_latent:
            out[f"{p}/latent_{x}/kernel"] = (f"blk.{i}.ffn_latent_{x}.weight",
                                             w[f"{p}/latent_{x}/kernel"])
    return out


def nemotron_h_tensors(weights: dict, cfg) -> tuple[dict, dict[str, str]]:
    """``(tensors, names)``: the model's weights (``{parameter path: QArray or array}``, as
    ``fp4lab.export.quantized_weights`` gives them) as llama.cpp's ``nemotron_h`` tensors,
    keyed by the path they come from (a derived tensor by a path of its own:
    ``blocks_0/mamba/A``, ``blocks_1/attention/qkv/q/kernel``), and ``{path: GGUF tensor
    name}``, for ``fp4lab.export.save(tensors, path, "gguf", names=names.__getitem__)``.
    The MTP head is left out; any other parameter the mapping does not know is an error."""
    from experiments.model import BLOCK_KINDS

    check_nemotron_h(cfg)
    w, mapped = dict(weights), {}
    mapped["embed/embedding"] = ("token_embd.weight", w["embed/embedding"])
    for i, letter in enumerate(cfg.pattern):
        kind, p = BLOCK_KINDS[letter], f"blocks_{i}"
        mapped[f"{p}/norm/scale"] = (f"blk.{i}.attn_norm.weight", w[f"{p}/norm/scale"])
        mapped |= (_mamba(f"{p}/mamba", w, i, 1) if kind == "mamba"
                   else _attention(f"{p}/attention", w, i) if kind == "attention"
                   else _moe(f"{p}/moe", w, i, cfg) if kind == "moe"
                   else _mlp(f"{p}/mlp", w, i))
    mapped["final_norm/scale"] = ("output_norm.weight", w["final_norm/scale"])
    mapped["head/kernel"] = ("output.weight", w["head/kernel"])
    used = {k for k in mapped} | {f"blocks_{i}/mamba/{x}" for i in range(len(cfg.pattern))
                                  for x in ("A_log", "conv_kernel")}
    used |= {f"blocks_{i}/attention/qkv/kernel" for i in range(len(cfg.pattern))}
    used |= {f"blocks_{i}/moe/experts/{x}" for i in range(len(cfg.pattern)) for x in ("up", "down")}
    left = sorted(k for k in w if k not in used and not k.startswith("mtp_"))
    if left:
        raise ValueError(f"parameters llama.cpp's {arch_of(cfg)} has no tensor for: "
                         f"{left[:5]}")
    return ({k: v for k, (_, v) in mapped.items()}, {k: n for k, (n, _) in mapped.items()})


def nemotron_h_metadata(cfg, *, context_length: int) -> dict:
    """The ``nemotron_h.*`` keys llama.cpp reads for ``cfg`` (a ModelConfig); with MoE
    blocks the ``nemotron_h_moe.*`` keys, the experts' among them (:func:`_moe_metadata`)."""
    from experiments.model import BLOCK_KINDS

    kinds = [BLOCK_KINDS[c] for c in cfg.pattern]
    d, inner = cfg.d_model, cfg.ssm_expand * cfg.d_model
    k = f"{arch_of(cfg)}."
    ffn = {"mlp": cfg.mlp_mult * d, "moe": cfg.expert_width}
    return {
        k + "context_length": int(context_length),
        k + "embedding_length": d,
        k + "block_count": len(kinds),
        k + "vocab_size": cfg.vocab,
        k + "feed_forward_length": [ffn.get(x, 0) for x in kinds],
        k + "attention.head_count": cfg.num_heads,
        k + "attention.head_count_kv": [cfg.num_heads if x == "attention" else 0
                                        for x in kinds],
        k + "attention.key_length": d // cfg.num_heads,
        k + "attention.value_length": d // cfg.num_heads,
        k + "attention.layer_norm_epsilon": RMS_EPS,
        k + "attention.layer_norm_rms_epsilon": RMS_EPS,
        k + "ssm.conv_kernel": cfg.conv_width,
        k + "ssm.inner_size": inner,
        k + "ssm.state_size": cfg.ssm_state,
        k + "ssm.time_step_rank": inner // cfg.ssm_head_dim,  # llama.cpp: the SSM heads
        k + "ssm.group_count": 1,
        **({k + key: v for key, v in _moe_metadata(cfg).items()} if "E" in cfg.pattern
           else {}),
    }


def _moe_metadata(cfg) -> dict:
    """llama.cpp's expert keys (typed as it reads them: the norm a bool, the scale a float):
    sigmoid routing is its only one for this architecture, the chosen scores normalized
    and unscaled; one shared-expert width for the file; no groups key (llama.cpp asserts
    fewer groups than experts, and reads no groups as one)."""
    from experiments.hf_nemotron_h import ZERO_SHARED

    return {"expert_count": cfg.moe_experts, "expert_used_count": cfg.moe_top_k,
            "expert_feed_forward_length": cfg.expert_width,
            "expert_shared_feed_forward_length": cfg.expert_width if cfg.moe_shared
            else ZERO_SHARED, "expert_shared_count": 1,
            "expert_weights_norm": True, "expert_weights_scale": 1.0,
            **({"moe_latent_size": cfg.moe_latent} if cfg.moe_latent else {})}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map: the character standing for each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _padded(tokens: dict[int, str], vocab: int) -> list[str]:
    if tokens and max(tokens) >= vocab:
        raise ValueError(f"the tokenizer has token id {max(tokens)}, beyond the model's "
                         f"vocabulary of {vocab}")
    return [tokens.get(i, f"[PAD{i}]") for i in range(vocab)]


def _bpe(path: Path, vocab: int) -> dict:
    t = json.loads(path.read_text())
    model = t.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: a {model.get('type')!r} tokenizer; llama.cpp's gpt2 "
                         "vocabulary takes a byte-level BPE")
    tokens = {i: s for s, i in model["vocab"].items()}
    special = {a["id"]: a["content"] for a in t.get("added_tokens", [])}
    tokens |= special
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.tokens": _padded(tokens, vocab),
            "tokenizer.ggml.merges": merges or [_NO_MERGE]}
    if special:  # experiments.tokenize's <|endoftext|> starts every document
        meta["tokenizer.ggml.bos_token_id"] = meta["tokenizer.ggml.eos_token_id"] = min(special)
    return meta


def tokenizer_metadata(data, vocab: int) -> dict:
    """The ``tokenizer.*`` keys for a run's data (``experiments.data``): bytes, a
    ``tokenizer.json`` beside the token files, or ids of an unknown tokenizer."""
    from experiments.data import TokenData

    common = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    if not isinstance(data, TokenData):  # byte tokens
        return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                "tokenizer.ggml.tokens": _padded(dict(enumerate(_byte_alphabet())), vocab),
                "tokenizer.ggml.merges": [_NO_MERGE], **common}
    path = Path(data.paths[0]).parent / "tokenizer.json"
    if path.is_file():
        return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                **_bpe(path, vocab), **common}
    return {"tokenizer.ggml.model": "none"}  # ids only: llama.cpp adds vocab_size tokens


def notes(cfg, arch: str) -> list[str]:
    """What the command says about a GGUF file of ``cfg`` written as ``arch``."""
    if arch != ARCH:
        return [f"general.architecture = {arch}: the tensors under fp4lab's names; no engine "
                "runs this file as a model (llama.cpp's gguf tools read it)"]
    out = [f"general.architecture = {arch_of(cfg)}: llama.cpp runs it (llama-cli, "
           "llama_cpp.Llama)"]
    if cfg.mtp:
        out.append("the multi-token-prediction head (mtp_*) is left out: llama.cpp's "
                   f"{arch_of(cfg)} runs the main head only")
    return out

