"""A small decoder-only hybrid Mamba-Transformer LM in the Nemotron-H style (Flax Linen).

Its GEMMs are written without fp4lab, like any user's model: their precision comes from a
policy applied with ``fp4lab.flax.quantize_model``. The precision decisions beyond the GEMMs
(below) call fp4lab's functions where a user's model would. Its layer paths are what the
policy presets expect:

* ``embed`` (an ``nn.Embed``, not a GEMM), ``head`` (the output projection), and the optional
  multi-token-prediction head ``mtp_proj``, ``mtp_block/mlp/{up,down}``, ``mtp_head`` (its own
  output projection, unlike DeepSeek-V3's shared one, so that every GEMM runs once per step
  and its probes measure one call);
* ``blocks_{i}/mamba/{in_proj,out_proj}``, ``blocks_{i}/attention/{qkv,out}``,
  ``blocks_{i}/mlp/{up,down}``;
* MoE blocks: ``blocks_{i}/moe/router`` (float32 unless ``moe_router_dtype`` says otherwise;
  fp4lab's policies leave a router alone unless a rule names it),
  ``blocks_{i}/moe/experts/ragged_dot_{0,1}`` (the expert stacks' up and down GEMMs, one
  ``jax.lax.ragged_dot`` each, which fp4lab quantizes expert by expert), the shared expert
  ``blocks_{i}/moe/shared_expert/{up,down}`` and LatentMoE's ``blocks_{i}/moe/latent_{down,up}``.

The block pattern uses Nemotron-H's letters: ``M`` Mamba-2 block, ``*`` attention block, ``-``
MLP block, ``E`` Mixture-of-Experts block. Every block is pre-norm residual:
``x + mixer(rmsnorm(x))``.

MoE block (``experiments.moe`` routes): a router GEMM and top-``moe_top_k`` of
``moe_experts`` scores (softmax or sigmoid, normalized over the chosen; float32), the tokens'
rows dispatched dropless, sorted by expert, through two expert GEMMs with the MLP's squared
ReLU between, and combined with the routing weights; Switch's load-balancing loss enters the
backward pass with weight ``moe_aux_loss``; ``moe_bias_rate`` > 0 balances the load by
DeepSeek-V3's auxiliary-loss-free rule instead or as well: a per-expert ``router_bias``
parameter added to the scores for the choice of experts only (the weights are the unbiased
scores), moved by the trainer after each step by ``moe_bias_rate`` towards the mean load
(``experiments.moe.ExpertLoads``; no gradient or optimizer touches it). ``moe_dispatch``
(a format: ``mxfp8``, ``mxfp4``, ``bf16``) rounds the dispatched rows as an expert-parallel
all-to-all in that format would deliver them (``fp4lab.beyond.dispatch``: forward only).
``moe_parallel`` splits the experts over the devices (expert parallelism, with the
data-parallel devices: ``experiments.moe.experts_over_devices``), the rows going to their
expert's device and back by all-to-all, and ``moe_dispatch`` then quantizes the real
all-to-all. ``moe_shared`` adds a shared expert (an MLP of the experts' width on every token);
``moe_latent`` > 0 makes it a LatentMoE (Nemotron 3): the tokens projected down to that width
before routing and dispatch, the experts working there, the combined output projected back
up (the router and shared expert see the full width). The experts' width ``moe_hidden`` defaults to ``mlp_mult * d / moe_top_k``, so a
token's active expert parameters match a dense MLP's.

Mamba-2 block: ``in_proj`` to (z, x, B, C, delta); a short causal depthwise convolution and
SiLU on (x, B, C); the selective scan with a scalar decay per head, with the time step
``delta_t = softplus(. + dt_bias)``: ``h_t = exp(delta_t A) h_{t-1} + delta_t x_t B_t^T``,
``y_t = h_t C_t + D x_t``, computed for all t at once with ``jax.lax.associative_scan``; the
gated RMSNorm ``norm(y * silu(z))``; ``out_proj``.

Compute runs in ``dtype`` (BF16 by default) on FP32 parameters (the master weights); the
scan, norms, softmax and loss run in FP32.

Precision decisions beyond the GEMMs, all off by default (docs/beyond_the_gemms.md):
``attention="flash"`` (``fp4lab.beyond.attention`` with ``attention_accumulate`` and
``attention_saved``: a dtype, or a block format in which the out projection stores its
input, DeepSeek-V3's one E5M6 copy), ``ssm_state_format`` / ``ssm_state_rounding`` (the
Mamba-2 recurrence one step at a time with its state stored in a format),
``residual_format`` / ``residual_gate`` (the residual stream stored in FP8 between blocks;
gated writes),
``mlp_saved`` (the squared ReLU recomputed in the backward pass from its input stored in a
format) and ``mtp_tied_head`` (the MTP logits through the main head's kernel).

Activations are named with their shapes, nanodo style: ``x_BxLxD`` has the axes B, L and D
(``2D``: one axis of size 2 * D; ``1``: a broadcast axis). The letters:

* ``B`` batch, ``L`` sequence length (``T`` too, for the key positions of attention scores),
  ``D`` model width (``d_model``), ``V`` vocabulary, ``F`` MLP hidden width (``mlp_mult * D``);
* attention: ``H`` heads, ``K`` head width (``D / H``);
* Mamba-2: ``E`` inner width (``ssm_expand * D``), ``H`` SSM heads of width ``P``
  (``ssm_head_dim``, ``E = H * P``), ``N`` state size (``ssm_state``), ``C`` the convolved
  channels ``E + 2N`` (x, B, C), ``O`` the outputs of ``in_proj`` (``E + C + H``: z, then
  x, B, C, then the time step), ``W`` the convolution width. The time step of the scan is
  ``delta`` (``dt`` in the papers; the parameter keeps its name ``dt_bias``); ``dtype`` is
  always the compute dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from experiments import moe
from experiments.moe import ROUTER_SCORES
from fp4lab.beyond.dispatch import check_dispatch_format, dispatched

__all__ = ["ModelConfig", "HybridLM", "BLOCK_KINDS", "recurrent_scan", "ssm_combine"]

BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
SSM_STATE_FORMATS = ("", "fp32", "bf16", "fp16", "int8_block128", "fp8_block128")
RESIDUAL_FORMATS = ("", "e4m3", "e4m3_token")


def residual_probes(model, params, tokens_BxL, **apply_kw) -> dict[str, dict[str, float]]:
    """Per block, what storing the residual stream in ``model.cfg.residual_format`` does to it:
    ``saturation`` (the share of elements clipped to E4M3's 448: beyond 464, half an ulp
    above it, after the per-token scale for ``e4m3_token``, where it is 0 by construction),
    ``underflow`` (nonzero values stored as 0), the
    relative MSE and SQNR (``fp4lab.numerics.metrics.error_metrics``), and the stream's abs-max.
    ``model``: a :class:`HybridLM` or one under a policy (``fp4lab.flax.quantize_model``;
    ``apply_kw`` then holds its ``rngs``)."""
    from fp4lab.numerics.metrics import error_metrics

    fmt = getattr(model, "model", model).cfg.residual_format
    if not fmt:
        raise ValueError("model.residual_format is '': the residual stream is not stored "
                         "in a low precision")
    _, seen = model.apply(params, tokens_BxL, mutable=["residual"], **apply_kw)
    out = {}
    for sown, (x,) in sorted(seen["residual"].items(), key=lambda kv: int(kv[0].split("_")[-1])):
        name = sown.removeprefix("after_")
        x = x.astype(jnp.float32)
        y = store_residual(x, fmt)
        scaled = x * (448.0 / jnp.max(jnp.abs(x), axis=-1, keepdims=True)) \
            if fmt == "e4m3_token" else x
        m = error_metrics(x, y)
        out[name] = {"saturation": float(jnp.mean(jnp.abs(scaled) > 464.0)),
                     "underflow": float(m["underflow"]), "rel_mse": float(m["rel_mse"]),
                     "sqnr_db": float(m["sqnr_db"]), "amax": float(jnp.max(jnp.abs(x)))}
    return out


def store_residual(x_BxLxD, fmt: str):
    """The residual stream as stored between blocks, with a straight-through gradient:
    ``e4m3`` rounds onto the E4M3 grid (saturating at 448, no scale; +-inf gives +-448, NaN
    stays NaN), ``e4m3_token`` scales each token by its abs-max first (fp4lab's
    ``fp8_e4m3_row``)."""
    from fp4lab import fake_quant
    from fp4lab.numerics.formats import E4M3
    from fp4lab.numerics.quantize import straight_through
    from fp4lab.numerics.rounding import round_nearest

    if not fmt:
        return x_BxLxD
    if fmt == "e4m3_token":
        return fake_quant(x_BxLxD, "fp8_e4m3_row", axis=-1)
    return straight_through(x_BxLxD, round_nearest(x_BxLxD, E4M3).astype(x_BxLxD.dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    pattern: str = "M-M*M-"
    d_model: int = 64
    vocab: int = 256
    num_heads: int = 4  # attention heads
    mlp_mult: int = 4
    ssm_expand: int = 2
    ssm_head_dim: int = 16
    ssm_state: int = 16
    conv_width: int = 4
    mtp: bool = False  # a multi-token-prediction head (predicts token t + 2)
    # the MTP logits through the main head's kernel (DeepSeek-V3's shared output layer, whose
    # gradient then sums both losses' parts; Nemotron 3 Ultra's BF16-reduction regression)
    mtp_tied_head: bool = False
    dtype: str = "bfloat16"
    # attention's softmax and P.V: "einsum" (FP32, as written here) or "flash"
    # (fp4lab.beyond.attention.flash_attention: key blocks of 64, the P.V rounding points
    # attention_accumulate, the output saved for the backward pass in attention_saved)
    attention: str = "einsum"
    attention_accumulate: str = "fp32"  # fp32 | bf16_p | bf16 (flash only)
    # the output as the backward pass sees it (flash only): a dtype it is saved in, or a
    # block format (e5m6_block128_pow2: DeepSeek-V3), the out projection's input as that
    # GEMM stores it (its recipe's saved_x; fp4lab.beyond.attention), with no copy of its own
    attention_saved: str = "float32"
    # the Mamba-2 state: "" (the parallel scan, FP32), or a recurrent scan storing the state
    # after every step in ssm_state_format (fp32, bf16, fp16, int8_block128, fp8_block128)
    # with ssm_state_rounding (nearest, or stochastic: the "ssm_state" rng, per step and layer)
    ssm_state_format: str = ""
    ssm_state_rounding: str = "nearest"
    # the residual stream between blocks: "" (FP32), "e4m3" (unscaled, saturating) or
    # "e4m3_token" (one abs-max scale per token), straight-through in training; and gated
    # residual writes x + sigmoid(g) * mixer(norm(x)) (g per channel, from 0)
    residual_format: str = ""
    residual_gate: bool = False
    # the MLP's squared ReLU kept for the backward pass as its input in this format and
    # recomputed from it (fp4lab.gemm.saved.recompute; Kimi K2's FP8-stored SwiGLU inputs); "" = off
    mlp_saved: str = ""
    # Mixture-of-Experts blocks (pattern letter E): experts, experts per token, expert width
    # (0: mlp_mult * width / top_k), router scores (softmax | sigmoid) and the router's GEMM
    # dtype, the load-balancing loss's weight (0: off), a shared expert, a LatentMoE width
    moe_experts: int = 8
    moe_top_k: int = 2
    moe_hidden: int = 0
    moe_router: str = "softmax"
    moe_router_dtype: str = "float32"
    moe_aux_loss: float = 0.01
    moe_shared: bool = False
    moe_latent: int = 0
    moe_bias_rate: float = 0.0
    moe_dispatch: str = ""
    # expert parallelism: the experts split over every device (the data-parallel ones),
    # all-to-all dispatch and return (in moe_dispatch's format, if set)
    moe_parallel: bool = False

    def __post_init__(self):
        bad = sorted(set(self.pattern) - set(BLOCK_KINDS))
        if bad or not self.pattern:
            raise ValueError(f"pattern {self.pattern!r}: unknown block kind(s) {bad}; known: "
                             + ", ".join(f"{k!r} ({v})" for k, v in BLOCK_KINDS.items()))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads="
                             f"{self.num_heads}")
        if (self.ssm_expand * self.d_model) % self.ssm_head_dim:
            raise ValueError(f"ssm_expand * d_model = {self.ssm_expand * self.d_model} is not "
                             f"divisible by ssm_head_dim={self.ssm_head_dim}")
        jnp.dtype(self.dtype)  # raises for an unknown dtype name
        if _attention_saved(self.attention_saved) is None:
            try:
                jnp.dtype(self.attention_saved)
            except TypeError:
                raise ValueError(f"attention_saved={self.attention_saved!r}: a dtype "
                                 "(float32, bfloat16) or a block format "
                                 "(e5m6_block128_pow2)") from None
        if self.mlp_saved:
            from fp4lab.numerics.formats import get_format

            get_format(self.mlp_saved)  # raises, naming the format and the known ones
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} must lie in [1, moe_experts="
                             f"{self.moe_experts}]")
        if self.moe_router not in ROUTER_SCORES:
            raise ValueError(f"moe_router={self.moe_router!r}: use one of {ROUTER_SCORES}")
        jnp.dtype(self.moe_router_dtype)
        for name in ("moe_hidden", "moe_latent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.moe_dispatch:
            check_dispatch_format(self.moe_dispatch)  # raises, naming the format
        for name in ("moe_aux_loss", "moe_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.attention not in ("einsum", "flash"):
            raise ValueError(f"attention={self.attention!r}: use 'einsum' or 'flash'")
        if self.residual_format not in RESIDUAL_FORMATS:
            raise ValueError(f"residual_format={self.residual_format!r}: use one of "
                             f"{RESIDUAL_FORMATS}")
        if self.ssm_state_format not in SSM_STATE_FORMATS:
            raise ValueError(f"ssm_state_format={self.ssm_state_format!r}: use one of "
                             f"{SSM_STATE_FORMATS}")
        if self.ssm_state_rounding not in ("nearest", "stochastic") or (
                self.ssm_state_rounding == "stochastic" and self.ssm_state_format == "fp32"):
            raise ValueError(f"ssm_state_rounding={self.ssm_state_rounding!r} for "
                             f"ssm_state_format={self.ssm_state_format!r}: nearest, or "
                             "stochastic for a format below FP32")

    @property
    def expert_width(self) -> int:
        """The width of an MoE block's experts (and of its shared expert): ``moe_hidden``,
        else the dense MLP's width over ``moe_top_k``."""
        return self.moe_hidden or self.mlp_mult * self.d_model // self.moe_top_k


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def _dense(features, name, dtype, zero=False):
    init = nn.initializers.zeros if zero else nn.initializers.lecun_normal()
    return nn.Dense(features, use_bias=False, dtype=dtype, kernel_init=init, name=name)


def _store_state(h_BxHxPxN, fmt: str, rounding: str, key):
    """The SSM state as stored between steps: in ``fmt`` (block formats: blocks along the
    flattened P x N state of each head), rounded to nearest or stochastically with ``key``."""
    from fp4lab import fake_quant

    if fmt == "fp32":
        return h_BxHxPxN
    shape = h_BxHxPxN.shape
    flat = h_BxHxPxN.reshape(shape[:2] + (-1,))
    kw = dict(rounding=rounding, key=key) if rounding == "stochastic" else {}
    return fake_quant(flat, fmt, axis=-1, **kw).reshape(shape)


def recurrent_scan(decay_BxLxHxPxN, inp_BxLxHxPxN, fmt: str, rounding: str, key):
    """``h_t = store(a_t h_{t-1} + b_t)`` one step at a time (a decode path's arithmetic); the
    key of step ``t`` is ``fold_in(key, t)``."""
    def step(h, xs):
        t, a, b = xs
        h = _store_state(a * h + b, fmt, rounding,
                         None if key is None else jax.random.fold_in(key, t))
        return h, h

    length = inp_BxLxHxPxN.shape[1]
    h0 = jnp.zeros(inp_BxLxHxPxN[:, 0].shape, jnp.float32)
    _, hs = jax.lax.scan(step, h0, (jnp.arange(length), decay_BxLxHxPxN.swapaxes(0, 1),
                                    inp_BxLxHxPxN.swapaxes(0, 1)))
    return hs.swapaxes(0, 1)


def ssm_combine(left, right):
    """Compose two steps of ``h -> a h + b`` (left first)."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


class Mamba2(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        batch, length, d = x_BxLxD.shape
        inner, n = cfg.ssm_expand * d, cfg.ssm_state
        heads, p = inner // cfg.ssm_head_dim, cfg.ssm_head_dim
        proj_BxLxO = _dense(2 * inner + 2 * n + heads, "in_proj", dtype)(x_BxLxD)
        z_BxLxE, xbc_BxLxC, delta_in_BxLxH = jnp.split(proj_BxLxO, [inner, 2 * inner + 2 * n],
                                                       axis=-1)
        # short causal depthwise convolution over time
        conv_WxC = self.param("conv_kernel", nn.initializers.lecun_normal(),
                              (cfg.conv_width, xbc_BxLxC.shape[-1]))
        conv_bias_C = self.param("conv_bias", nn.initializers.zeros, (xbc_BxLxC.shape[-1],))
        padded = jnp.pad(xbc_BxLxC.astype(jnp.float32),
                         ((0, 0), (cfg.conv_width - 1, 0), (0, 0)))
        xbc_BxLxC = sum(padded[:, k:k + length] * conv_WxC[k]
                        for k in range(cfg.conv_width)) + conv_bias_C
        xbc_BxLxC = jax.nn.silu(xbc_BxLxC)
        xs_BxLxE, ssm_b_BxLxN, ssm_c_BxLxN = jnp.split(xbc_BxLxC, [inner, inner + n], axis=-1)
        # selective scan (float32)
        delta_bias_H = self.param("dt_bias", lambda k, s: jnp.log(jnp.expm1(
            jnp.exp(jax.random.uniform(k, s, minval=jnp.log(1e-3), maxval=jnp.log(1e-1))))),
            (heads,))
        a_log_H = self.param("A_log", lambda k, s: jnp.log(jax.random.uniform(
            k, s, minval=1.0, maxval=16.0)), (heads,))
        skip_H = self.param("D", nn.initializers.ones, (heads,))
        delta_BxLxH = jax.nn.softplus(delta_in_BxLxH.astype(jnp.float32) + delta_bias_H)
        decay_BxLxHx1x1 = jnp.exp(delta_BxLxH * -jnp.exp(a_log_H))[..., None, None]
        x_BxLxHxP = xs_BxLxE.reshape(batch, length, heads, p)
        inp_BxLxHxPxN = ((x_BxLxHxP * delta_BxLxH[..., None])[..., None]
                         * ssm_b_BxLxN[:, :, None, None, :])
        decay_BxLxHxPxN = jnp.broadcast_to(decay_BxLxHx1x1, inp_BxLxHxPxN.shape)
        if cfg.ssm_state_format:
            key = (self.make_rng("ssm_state") if cfg.ssm_state_rounding == "stochastic"
                   else None)
            h_BxLxHxPxN = recurrent_scan(decay_BxLxHxPxN, inp_BxLxHxPxN, cfg.ssm_state_format,
                                          cfg.ssm_state_rounding, key)
        else:
            _, h_BxLxHxPxN = jax.lax.associative_scan(
                ssm_combine, (decay_BxLxHxPxN, inp_BxLxHxPxN), axis=1)
        y_BxLxHxP = (jnp.einsum("blhpn,bln->blhp", h_BxLxHxPxN, ssm_c_BxLxN)
                     + x_BxLxHxP * skip_H[:, None])
        y_BxLxE = (y_BxLxHxP.reshape(batch, length, inner)
                   * jax.nn.silu(z_BxLxE.astype(jnp.float32)))
        y_BxLxE = RMSNorm(name="norm")(y_BxLxE).astype(dtype)
        return _dense(d, "out_proj", dtype)(y_BxLxE)


def _attention_saved(name: str):
    """``model.attention_saved`` as a block format (None for a dtype name)."""
    from fp4lab.numerics.formats import FORMATS

    fmt = FORMATS.get(name)
    return None if fmt is None or fmt.is_passthrough else fmt


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        batch, length, d = x_BxLxD.shape
        hd = d // cfg.num_heads
        qkv_BxLx3xHxK = _dense(3 * d, "qkv", dtype)(x_BxLxD).reshape(
            batch, length, 3, cfg.num_heads, hd)
        q_BxLxHxK, k_BxTxHxK, v_BxTxHxK = (qkv_BxLx3xHxK[:, :, i].astype(jnp.float32)
                                           for i in range(3))
        if cfg.attention == "flash":
            from fp4lab.beyond.attention import flash_attention

            heads = [x.transpose(0, 2, 1, 3) for x in (q_BxLxHxK, k_BxTxHxK, v_BxTxHxK)]
            saved = _attention_saved(cfg.attention_saved)
            # a block format: the backward's O is the out projection's stored input (same
            # dtype, same blocks); a dtype: O saved in it
            kw = (dict(saved_format=saved, out_dtype=dtype) if saved is not None
                  else dict(saved_dtype=cfg.attention_saved))
            o_BxHxLxK = flash_attention(*heads, causal=True, accumulate=cfg.attention_accumulate,
                                        **kw)
            o_BxLxD = o_BxHxLxK.transpose(0, 2, 1, 3).reshape(batch, length, d).astype(dtype)
            return _dense(d, "out", dtype)(o_BxLxD)
        scores_BxHxLxT = (jnp.einsum("bqhd,bkhd->bhqk", q_BxLxHxK, k_BxTxHxK)
                          / jnp.sqrt(hd).astype(jnp.float32))
        causal_LxT = jnp.tril(jnp.ones((length, length), bool))
        probs_BxHxLxT = jax.nn.softmax(jnp.where(causal_LxT, scores_BxHxLxT, -jnp.inf), axis=-1)
        o_BxLxD = jnp.einsum("bhqk,bkhd->bqhd", probs_BxHxLxT, v_BxTxHxK).reshape(
            batch, length, d).astype(dtype)
        return _dense(d, "out", dtype)(o_BxLxD)


def _relu2(h):
    return jnp.square(jax.nn.relu(h))


class MLP(nn.Module):
    cfg: ModelConfig
    hidden: int = 0  # 0: mlp_mult * width

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        h_BxLxF = _dense(self.hidden or cfg.mlp_mult * x_BxLxD.shape[-1], "up", dtype)(x_BxLxD)
        act = _relu2
        if cfg.mlp_saved:
            from fp4lab.gemm.saved import recompute

            act = recompute(_relu2, cfg.mlp_saved)
        return _dense(x_BxLxD.shape[-1], "down", dtype)(act(h_BxLxF))


def expert_stacks(cfg: ModelConfig) -> dict[str, str]:
    """``{stack path: call path}``: each MoE block's expert stacks and the ``ragged_dot``
    call of :class:`Experts` that multiplies it (up first, then down), as
    ``fp4lab.export.quantized_weights(..., experts=)`` takes them."""
    return {f"blocks_{i}/moe/experts/{x}": f"blocks_{i}/moe/experts/ragged_dot_{n}"
            for i, c in enumerate(cfg.pattern) if c == "E" for n, x in enumerate(("up", "down"))}


class Experts(nn.Module):
    """``moe_experts`` expert MLPs (up, squared ReLU, down) on the tokens routed to them:
    dispatched dropless into rows sorted by expert, two ``jax.lax.ragged_dot`` calls on
    stacked float32 weights cast to the compute dtype, combined with the routing weights.
    With ``moe_parallel`` the experts split over the devices (``moe.experts_over_devices``:
    all-to-all dispatch and return, each expert's GEMMs bit for bit the one-device ones)."""

    cfg: ModelConfig
    hidden: int

    @nn.compact
    def __call__(self, z_TxZ, experts_TxK, weights_TxK):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        d, e = z_TxZ.shape[-1], cfg.moe_experts
        init = nn.initializers.lecun_normal(batch_axis=(0,))  # per expert: fan-in d
        stacks = (self.param("up", init, (e, d, self.hidden)),
                  self.param("down", init, (e, self.hidden, d)))

        def experts_of(up_ExDxF, down_ExFxD):
            def experts(rows_RxZ, sizes_E):
                h_RxF = jax.lax.ragged_dot(rows_RxZ.astype(dtype), up_ExDxF.astype(dtype),
                                           sizes_E)
                return jax.lax.ragged_dot(_relu2(h_RxF), down_ExFxD.astype(dtype), sizes_E)
            return experts

        if cfg.moe_parallel:
            return moe.experts_over_devices(z_TxZ, experts_TxK, weights_TxK, stacks,
                                            experts_of, e, cfg.moe_dispatch or None)
        rows_RxZ, sizes_E, order_R = moe.dispatch(z_TxZ, experts_TxK, e)
        if cfg.moe_dispatch:  # the rows as an expert-parallel dispatch in that format sends them
            rows_RxZ = dispatched(rows_RxZ, cfg.moe_dispatch)
        return moe.combine(experts_of(*stacks)(rows_RxZ, sizes_E), order_R, weights_TxK)


class MoE(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        batch, length, d = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(batch * length, d)
        router_dtype = jnp.dtype(cfg.moe_router_dtype)
        logits_TxE = _dense(cfg.moe_experts, "router", router_dtype)(x_TxD.astype(router_dtype))
        bias_E = (self.param(moe.BIAS, nn.initializers.zeros, (cfg.moe_experts,), jnp.float32)
                  if cfg.moe_bias_rate else None)
        weights_TxK, experts_TxK, probs_TxE = moe.route(logits_TxE, cfg.moe_top_k,
                                                        cfg.moe_router, bias_E)
        z_TxZ = _dense(cfg.moe_latent, "latent_down", dtype)(x_TxD) if cfg.moe_latent else x_TxD
        hidden = cfg.expert_width
        y_TxD = Experts(cfg, hidden, name="experts")(z_TxZ, experts_TxK, weights_TxK).astype(
            dtype)
        if cfg.moe_latent:
            y_TxD = _dense(d, "latent_up", dtype)(y_TxD)
        if self.has_variable(moe.LOADS, "load"):  # the trainer observes the experts' loads
            y_TxD = moe.observe_load(y_TxD, self.get_variable(moe.LOADS, "load"),
                                     moe.expert_load(experts_TxK, cfg.moe_experts))
        if cfg.moe_aux_loss:
            y_TxD = moe.with_aux_loss(y_TxD, moe.balance_loss(probs_TxE, experts_TxK),
                                      cfg.moe_aux_loss)
        if cfg.moe_shared:
            y_TxD = y_TxD + MLP(cfg, hidden, name="shared_expert")(x_TxD.astype(dtype))
        return y_TxD.reshape(batch, length, d)


_MIXERS = {"mamba": Mamba2, "attention": Attention, "mlp": MLP, "moe": MoE}


class Block(nn.Module):
    cfg: ModelConfig
    kind: str

    @nn.compact
    def __call__(self, x_BxLxD):
        h_BxLxD = _MIXERS[self.kind](self.cfg, name=self.kind)(RMSNorm(name="norm")(x_BxLxD))
        h_BxLxD = h_BxLxD.astype(x_BxLxD.dtype)
        if self.cfg.residual_gate:
            gate_D = self.param("residual_gate", nn.initializers.zeros, (x_BxLxD.shape[-1],))
            h_BxLxD = h_BxLxD * jax.nn.sigmoid(gate_D)
        return x_BxLxD + h_BxLxD


class HybridLM(nn.Module):
    """``__call__(tokens_BxL) -> (logits_BxLxV, mtp_logits_BxLxV or None)``, float32 logits.

    ``mtp_logits[:, t]`` predicts token ``t + 2`` from the hidden state at ``t`` and the
    embedding of token ``t + 1`` (the last position sees a zero embedding)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed")
        x_BxLxD = embed(tokens_BxL).astype(jnp.float32)  # the residual stream stays in float32
        for i, letter in enumerate(cfg.pattern):
            x_BxLxD = Block(cfg, BLOCK_KINDS[letter], name=f"blocks_{i}")(x_BxLxD)
            if cfg.residual_format:
                self.sow("residual", f"after_blocks_{i}", x_BxLxD)  # before storage: probes
                x_BxLxD = store_residual(x_BxLxD, cfg.residual_format)
        final_norm = RMSNorm(name="final_norm")
        head = _dense(cfg.vocab, "head", dtype)
        logits_BxLxV = head(final_norm(x_BxLxD).astype(dtype)).astype(jnp.float32)
        if not cfg.mtp:
            return logits_BxLxV, None
        next_BxLxD = jnp.pad(embed(tokens_BxL[:, 1:]), ((0, 0), (0, 1), (0, 0)))
        hm_BxLx2D = jnp.concatenate([RMSNorm(name="mtp_norm_h")(x_BxLxD),
                                     RMSNorm(name="mtp_norm_e")(next_BxLxD)],
                                    axis=-1).astype(dtype)
        hm_BxLxD = _dense(cfg.d_model, "mtp_proj", dtype)(hm_BxLx2D).astype(jnp.float32)
        hm_BxLxD = Block(cfg, "mlp", name="mtp_block")(hm_BxLxD)
        hm_BxLxD = final_norm(hm_BxLxD).astype(dtype)
        if cfg.mtp_tied_head:  # the head's kernel in a plain einsum (no policy layer rule)
            kernel_DxV = head.variables["params"]["kernel"].astype(dtype)
            return logits_BxLxV, jnp.einsum("bld,dv->blv", hm_BxLxD, kernel_DxV).astype(
                jnp.float32)
        mtp_head = _dense(cfg.vocab, "mtp_head", dtype)
        return logits_BxLxV, mtp_head(hm_BxLxD).astype(jnp.float32)
