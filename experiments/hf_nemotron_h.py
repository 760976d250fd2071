"""A hybrid-LM run as transformers' ``NemotronHForCausalLM`` (``models/nemotron_h``, checked
with transformers 5.24): a folder of ``config.json`` and ``model.safetensors`` that
``NemotronHForCausalLM.from_pretrained`` loads, with BF16 weights or as a compressed-tensors
NVFP4 checkpoint (``fp4lab.export``'s ``nvfp4`` layout, or ModelOpt's ``nvfp4_modelopt``);
``python -m experiments.export --layout bf16 | nvfp4 | nvfp4_modelopt`` writes one.

BF16: every parameter cast to BF16. NVFP4: each kernel quantized
as the run's model computes it under its policy (or ``--policy``; the quantized model's
record: recipe and compute dtype per GEMM, as ``experiments.export`` does), written by
``fp4lab.export.save(..., "nvfp4", names=hf_name)`` into the folder whose ``config.json``
(NemotronH's) was written first, so the export extends it with ``quantization_config``;
embeddings, norms, the convolution and the SSM parameters stay float32. Every layer of the
policy must then quantize its weight to NVFP4 (or pass it through), else ``save`` refuses
and names the tensor. The output folder must not exist or be empty; it is written under a
temporary name and renamed once complete.

The tensors (``blocks_{i}`` is NemotronH's ``model.layers.{i}``; kernels ``[in, out]``
become ``[out, in]`` weights):

=====================================  ==================================================
hybrid LM                              NemotronH
=====================================  ==================================================
``embed/embedding`` [V, D]             ``model.embeddings.weight``
``blocks_{i}/norm/scale``              ``model.layers.{i}.norm.weight``
``mamba/in_proj``, ``out_proj``        ``mixer.in_proj``, ``mixer.out_proj`` (z, xBC, dt)
``mamba/conv_kernel`` [W, C]           ``mixer.conv1d.weight`` [C, 1, W] (its transpose)
``mamba/conv_bias``                    ``mixer.conv1d.bias``
``mamba/A_log``, ``D``, ``dt_bias``    ``mixer.A_log``, ``mixer.D``, ``mixer.dt_bias``
``mamba/norm/scale``                   ``mixer.norm.weight`` (the gated RMSNorm)
``attention/qkv`` [D, 3D]              ``mixer.q_proj``, ``k_proj``, ``v_proj`` (its thirds)
``attention/out``                      ``mixer.o_proj``
``mlp/up``, ``mlp/down``               ``mixer.up_proj``, ``mixer.down_proj``
``final_norm/scale``                   ``model.norm_f.weight``
``head`` [D, V]                        ``lm_head.weight`` (untied)
=====================================  ==================================================

The fused ``qkv`` kernel under NVFP4 was quantized with one tensor amax: its codes and block
scales are split by columns (blocks run along the input axis, so each third keeps its bytes),
and the three modules carry the same ``weight_global_scale``.

Where the hybrid LM and transformers' NemotronH differ, and what the config does about it:

* norm eps: every RMSNorm of the hybrid LM uses 1e-6; NemotronH one ``layer_norm_epsilon``
  (default 1e-5) for the block norms, ``norm_f`` and the gated norm: written as 1e-6.
* gated RMSNorm: both ``norm(y * silu(z))`` in float32 (gate before the norm); NemotronH
  normalizes in ``n_groups`` groups, the hybrid LM over the whole inner width with one B and
  C for all heads: ``n_groups = 1``. NemotronH multiplies the norm weight after casting to
  the model dtype, the hybrid LM before (the same in a float32 model).
* time step: NemotronH's mixer clamps ``softplus(dt + dt_bias)`` to ``[time_step_min,
  inf)`` (default 1e-3; ``time_step_limit`` is not read); the hybrid LM does not clamp:
  ``time_step_min = 0.0``, a no-op on softplus's output. (``time_step_min`` also draws
  ``dt_bias`` at initialization, which a loaded checkpoint skips.)
* residual stream: the hybrid LM keeps it in float32 whatever its compute dtype;
  NemotronH 5.24 keeps it in the model's dtype (``residual_in_fp32`` is written true, as
  the model has it, but 5.24 does not read it): equal when served in float32, rounded to
  BF16 after every block when served in BF16.
* attention: no RoPE in either; ``num_key_value_heads = num_attention_heads``; scores times
  ``head_dim ** -0.5`` in NemotronH, divided by ``sqrt(head_dim)`` in the hybrid LM (the
  same for a power-of-4 head width, else up to an ulp).
* the scan: NemotronH's chunked SSD (``chunk_size`` 128) or mamba-ssm's kernels, the
  hybrid LM's associative scan: the same recurrence, summed in another order.
* the precision policy: the checkpoint holds weights (BF16, or NVFP4 weights), and the
  engine runs unquantized activations; a QAT policy's activation quantization is not in it.
* the multi-token-prediction head (``mtp``) is left out: NemotronH's MTP layers
  (``num_nextn_predict_layers``) are DeepSeek-V3-style blocks that transformers does not
  load (``mtp.*`` is ignored); the main model is exported alone and the config says so.

A run whose model options change the forward pass in a way NemotronH cannot compute is
refused, naming the option (:data:`UNSUPPORTED`): ``residual_format`` (the residual stream
rounded to FP8 between blocks), ``residual_gate`` (gated residual writes),
``ssm_state_format`` below float32 (the SSM state rounded every step) and flash attention's
``attention_accumulate`` other than fp32 (BF16 P.V roundings). Backward-only options
(``attention_saved``, ``mlp_saved``), flash attention in float32 and an fp32-stored state
do not change the forward pass and are accepted.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from experiments.engines import split_columns
from experiments.model import ModelConfig, RMSNorm, expert_stacks

__all__ = ["UNSUPPORTED", "HF_BLOCKS", "ZERO_SHARED", "check_expressible", "hf_config", "hf_name",
           "hf_layout", "moe_stand_ins", "notes", "write_bf16", "write_nvfp4", "check_output", "refused_options"]

HF_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # 5.24's
# the width of the all-zero shared expert written for MoE blocks without one (transformers
# builds a shared expert in every MoE block, and a width of 0 would mean the dense MLP's)
ZERO_SHARED = 16

# option -> (is the forward NemotronH cannot compute?, why)
UNSUPPORTED = {
    "residual_format": (lambda c: bool(c.residual_format),
                        "the residual stream rounded to FP8 between blocks"),
    "residual_gate": (lambda c: c.residual_gate, "gated residual writes x + sigmoid(g) * h"),
    "ssm_state_format": (lambda c: c.ssm_state_format not in ("", "fp32"),
                         "the SSM state rounded to a low precision after every step"),
    "attention_accumulate": (lambda c: c.attention == "flash"
                             and c.attention_accumulate != "fp32",
                             "flash attention's P.V with BF16 roundings"),
    # MoE blocks: NemotronH routes by sigmoid scores, their bias choosing but not weighing,
    # the chosen scores normalized (moe.route's sigmoid), in float32, over its grouped top-k
    "moe_router": (lambda c: "E" in c.pattern and c.moe_router != "sigmoid" and (
        c.moe_top_k > 1 or c.moe_bias_rate > 0),
        "softmax routing weights (NemotronH weighs the chosen experts by sigmoid scores; "
        "softmax is expressible only with one expert per token and no routing bias)"),
    "moe_experts": (lambda c: "E" in c.pattern and c.moe_experts < 2,
                    "fewer than 2 experts (NemotronH's grouped top-k sums a group's best two)"),
    "moe_router_dtype": (lambda c: "E" in c.pattern and c.moe_router_dtype != "float32",
                         "router logits below float32 (NemotronH's router is float32)"),
    "moe_dispatch": (lambda c: "E" in c.pattern and bool(c.moe_dispatch),
                     "the experts' rows rounded to a low precision on their way to them"),
}

_TOP = {"embed/embedding": "model.embeddings.weight", "final_norm/scale": "model.norm_f.weight",
        "head/kernel": "lm_head.weight"}
_MIXER = {  # a block's mixer parameter (after hf_layout) -> NemotronH's name under mixer.
    "mamba": {"in_proj/kernel": "in_proj.weight", "out_proj/kernel": "out_proj.weight",
              "conv1d/weight": "conv1d.weight", "conv_bias": "conv1d.bias",
              "A_log": "A_log", "D": "D", "dt_bias": "dt_bias", "norm/scale": "norm.weight"},
    "attention": {"q_proj/kernel": "q_proj.weight", "k_proj/kernel": "k_proj.weight",
                  "v_proj/kernel": "v_proj.weight", "out/kernel": "o_proj.weight"},
    "mlp": {"up/kernel": "up_proj.weight", "down/kernel": "down_proj.weight"},
    "moe": {"router/kernel": "gate.weight", "router_bias": "gate.e_score_correction_bias",
            "latent_down/kernel": "fc1_latent_proj.weight",
            "latent_up/kernel": "fc2_latent_proj.weight",
            "shared_expert/up/kernel": "shared_experts.up_proj.weight",
            "shared_expert/down/kernel": "shared_experts.down_proj.weight"},
}
_EXPERT = re.compile(r"experts/(\d+)/(up|down)/kernel")  # one expert of a stack (hf_layout)
_FLOAT32 = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")  # kept so by NemotronH
_MTP = ("mtp_proj/", "mtp_block/", "mtp_norm_h/", "mtp_norm_e/", "mtp_head/")


def notes(cfg: ModelConfig, layout: str) -> list[str]:
    """What the export command says about a NemotronH folder of ``cfg`` in ``layout``."""
    out = []
    if layout == "nvfp4" and "E" in cfg.pattern:
        out.append("the expert stacks are NVFP4 modules, one global scale per expert: vLLM "
                   "serves them, transformers 5.24 does not (it decompresses its fused "
                   "experts without their weight_global_scale, each 2688 / amax off); "
                   "serve this run in transformers from --layout bf16")
    if cfg.mtp:
        out.append("the multi-token-prediction head (mtp_*) is left out: transformers' "
                   "NemotronH does not load DeepSeek-V3-style MTP layers")
    return out


def refused_options(cfg: ModelConfig) -> list[str]:
    """``option=value (why)`` for each model option of ``cfg`` whose forward pass the engines'
    Nemotron-H (transformers' and llama.cpp's) cannot compute (:data:`UNSUPPORTED`)."""
    return [f"{option}={getattr(cfg, option)!r} ({what})"
            for option, (refused, what) in UNSUPPORTED.items() if refused(cfg)]


def check_expressible(cfg: ModelConfig) -> None:
    """ValueError naming every model option of ``cfg`` that transformers' NemotronH cannot
    compute (:func:`refused_options`)."""
    bad = refused_options(cfg)
    if bad:
        raise ValueError("model option " + "; model option ".join(bad) + ": transformers' "
                         "NemotronHForCausalLM cannot express it; export a run with these "
                         "options at their defaults")


def hf_config(cfg: ModelConfig, *, max_positions: int) -> dict:
    """NemotronH's ``config.json`` for the hybrid LM ``cfg`` (refused by
    :func:`check_expressible` if transformers cannot express it). ``max_positions``: the
    trained sequence length (NemotronH has no position embedding; informational)."""
    check_expressible(cfg)
    d, inner = cfg.d_model, cfg.ssm_expand * cfg.d_model
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": cfg.vocab, "hidden_size": d, "tie_word_embeddings": False,
        "layers_block_type": [HF_BLOCKS[c] for c in cfg.pattern],
        "hybrid_override_pattern": cfg.pattern,  # the older spelling (vLLM, transformers 4)
        "num_hidden_layers": len(cfg.pattern),
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "head_dim": d // cfg.num_heads, "attention_bias": False,
        "max_position_embeddings": max_positions,
        "intermediate_size": cfg.mlp_mult * d, "mlp_hidden_act": "relu2", "mlp_bias": False,
        "mamba_num_heads": inner // cfg.ssm_head_dim, "mamba_head_dim": cfg.ssm_head_dim,
        "expand": cfg.ssm_expand, "n_groups": 1, "ssm_state_size": cfg.ssm_state,
        "conv_kernel": cfg.conv_width, "use_conv_bias": True, "mamba_hidden_act": "silu",
        "mamba_proj_bias": False, "use_bias": False, "chunk_size": 128,
        "time_step_min": 0.0,  # the mixer's lower clamp of the time step: none
        "layer_norm_epsilon": RMSNorm.eps, "residual_in_fp32": True,
        "num_nextn_predict_layers": 0,  # the MTP head is left out
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "use_cache": True, "dtype": cfg.dtype, **(_moe_config(cfg) if "E" in cfg.pattern else {}),
    }


def _moe_config(cfg: ModelConfig) -> dict:
    """NemotronH's MoE keys: ``moe_experts`` routed experts, ``moe_top_k`` per token by
    sigmoid scores (one group, the chosen scores normalized, unscaled), experts of
    :attr:`ModelConfig.expert_width` (on ``moe_latent`` features when set), one shared expert (an all-zero
    one of :data:`ZERO_SHARED` without ``moe_shared``)."""
    return {"n_routed_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.expert_width, "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": cfg.expert_width if cfg.moe_shared
            else ZERO_SHARED, "moe_latent_size": cfg.moe_latent or None, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def hf_name(path: str) -> str:
    """NemotronH's tensor name of a path of :func:`hf_layout`'s output
    (``blocks_2/attention/q_proj/kernel`` -> ``model.layers.2.mixer.q_proj.weight``)."""
    if path in _TOP:
        return _TOP[path]
    m = re.fullmatch(r"blocks_(\d+)/(norm/scale|(mamba|attention|mlp|moe)/(.+))", path)
    if m and m[2] == "norm/scale":
        return f"model.layers.{m[1]}.norm.weight"
    if m and m[4] in _MIXER[m[3]]:
        return f"model.layers.{m[1]}.mixer.{_MIXER[m[3]][m[4]]}"
    expert = m and m[3] == "moe" and _EXPERT.fullmatch(m[4])
    if expert:
        return f"model.layers.{m[1]}.mixer.experts.{expert[1]}.{expert[2]}_proj.weight"
    raise ValueError(f"{path=}: no NemotronH tensor for it")


def hf_layout(weights: dict, cfg: ModelConfig) -> dict:
    """``weights`` (``{parameter path: array or QArray}``) in NemotronH's layout, still keyed
    by paths (:func:`hf_name` names them; kernels stay ``[in, out]``): ``qkv`` split into
    ``q_proj``, ``k_proj``, ``v_proj`` (:func:`experiments.engines.split_columns`: a
    quantized kernel's codes and scales split with it, its tensor amax shared), the
    convolution ``[W, C]`` as ``conv1d/weight`` ``[C, 1, W]``, the MTP head's parameters left
    out. Every other path must have a NemotronH name."""
    d, out = cfg.d_model, {}
    for path, value in weights.items():
        layer, _, leaf = path.rpartition("/")
        if path.startswith(_MTP):
            continue
        if layer.endswith("/attention/qkv") and leaf == "kernel":
            base = layer.rpartition("/")[0]
            out.update({f"{base}/{n}_proj/kernel": v
                        for n, v in zip("qkv", split_columns(value, [d, d, d]), strict=True)})
        elif leaf == "conv_kernel":
            out[f"{layer}/conv1d/weight"] = np.ascontiguousarray(np.asarray(value).T[:, None])
        elif layer.endswith("/moe/experts"):  # a stack [E, in, out] (or a tuple of E
            # QArrays): one kernel per expert
            parts = value if isinstance(value, tuple) else np.asarray(value)
            out.update({f"{layer}/{j}/{leaf}/kernel": w for j, w in enumerate(parts)})
        else:
            out[path] = value
    for i, kind in enumerate(cfg.pattern):
        if kind == "E":
            out.update({k: v for k, v in moe_stand_ins(cfg, f"blocks_{i}/moe").items()
                        if k not in out})
    for path in out:
        hf_name(path)  # every tensor has a name before anything is written
    return out


def moe_stand_ins(cfg: ModelConfig, block: str) -> dict[str, np.ndarray]:
    """What NemotronH's MoE block has and the hybrid LM's may lack, as the same computation:
    a zero routing bias (without ``moe_bias_rate``), an all-zero shared expert of
    :data:`ZERO_SHARED` (without ``moe_shared``: ``relu(0)^2 = 0`` adds nothing)."""
    d = cfg.d_model
    return {f"{block}/router_bias": np.zeros(cfg.moe_experts, np.float32),
            f"{block}/shared_expert/up/kernel": np.zeros((d, ZERO_SHARED), np.float32),
            f"{block}/shared_expert/down/kernel": np.zeros((ZERO_SHARED, d), np.float32)}


def _flat(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(params.get("params", params))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in flat}


def check_output(out) -> Path:
    """``out`` as a Path, refused (before any work) unless it is a new or empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output folder {str(out)!r} exists and is not an empty folder; "
                         "choose a new one")
    return out


class _Folder:
    """``out`` written under a temporary name beside it and renamed once complete; an
    ``out`` that exists and is not an empty folder is refused before anything is written."""

    def __init__(self, out):
        self.out = check_output(out)

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        return self.tmp

    def __exit__(self, kind, *_):
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        mask = _umask()  # the ordinary modes (mkdtemp's folder is 0700)
        self.tmp.chmod(0o777 & ~mask)
        for f in self.tmp.iterdir():
            f.chmod(0o666 & ~mask)
        if self.out.exists():
            self.out.rmdir()  # empty (checked)
        self.tmp.rename(self.out)
        return False


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_config(folder: Path, cfg: ModelConfig, max_positions: int, meta: dict) -> None:
    config = {**hf_config(cfg, max_positions=max_positions), "fp4lab": meta}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _meta(cfg: ModelConfig, weights: str, metadata) -> dict:
    """``config.json``'s ``fp4lab`` section: the weights, ``metadata``, and whether the MTP
    head was left out."""
    return {"weights": weights, **(metadata or {}),
            **({"mtp": "left out (not exported)"} if cfg.mtp else {})}


def write_bf16(params, cfg: ModelConfig, out, *, max_positions: int,
               metadata: dict | None = None) -> Path:
    """Write ``params`` (the hybrid LM's, float32) to the folder ``out`` as a BF16
    NemotronH checkpoint: ``config.json`` (:func:`hf_config`, with ``metadata`` under
    ``fp4lab``) and ``model.safetensors``, every tensor BF16. Returns ``out``."""
    from safetensors.numpy import save_file

    check_expressible(cfg)
    laid = hf_layout(_flat(params), cfg)
    tensors = {}
    for path, value in laid.items():
        name = hf_name(path)
        a = np.asarray(value, np.float32)
        a = a if name.endswith(_FLOAT32) else a.astype(ml_dtypes.bfloat16)
        tensors[name] = np.ascontiguousarray(a.T if path.endswith("/kernel") else a)
    with _Folder(out) as tmp:
        _write_config(tmp, cfg, max_positions, _meta(cfg, "bf16", metadata))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out)


def write_nvfp4(params, record, cfg: ModelConfig, out, *, max_positions: int,
                metadata: dict | None = None, layout: str = "nvfp4") -> Path:
    """Write ``params`` to the folder ``out`` as an NVFP4 NemotronH checkpoint in ``layout``
    (``nvfp4``: compressed-tensors; ``nvfp4_modelopt``: ModelOpt's, weight-only):
    :func:`hf_config`'s ``config.json`` first, then ``fp4lab.export.save(..., layout,
    names=hf_name)``, which extends it with ``quantization_config``. ``record``: the quantized model's assignments
    (``QuantizedLinen.assignments``), what each kernel's forward GEMM did. Returns ``out``."""
    from fp4lab import export

    check_expressible(cfg)
    laid = hf_layout(export.quantized_weights({"params": params}, record,
                                              experts=expert_stacks(cfg)), cfg)
    with _Folder(out) as tmp:
        meta = _meta(cfg, layout, metadata)
        _write_config(tmp, cfg, max_positions, meta)  # save extends it (its fp4lab: meta)
        export.save(laid, tmp, layout, names=hf_name, metadata=meta)
    return Path(out)
