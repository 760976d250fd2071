"""A small decoder-only hybrid Mamba-Transformer LM in the Nemotron-H style (Flax Linen).

Written without fp4lab, like any user's model: precision comes from a policy applied with
``fp4lab.flax.quantize_model``. Its layer paths are what the policy presets expect:

* ``embed`` (an ``nn.Embed``, not a GEMM), ``head`` (the output projection), and the optional
  multi-token-prediction head ``mtp_proj``, ``mtp_block/mlp/{up,down}``, ``mtp_head`` (its own
  output projection, unlike DeepSeek-V3's shared one, so that every GEMM runs once per step
  and its probes measure one call);
* ``blocks_{i}/mamba/{in_proj,out_proj}``, ``blocks_{i}/attention/{qkv,out}``,
  ``blocks_{i}/mlp/{up,down}``.

The block pattern uses Nemotron-H's letters: ``M`` Mamba-2 block, ``*`` attention block, ``-``
MLP block. Every block is pre-norm residual: ``x + mixer(rmsnorm(x))``.

Mamba-2 block: ``in_proj`` to (z, x, B, C, dt); a short causal depthwise convolution and SiLU on
(x, B, C); the selective scan with a scalar decay per head, ``h_t = exp(dt_t A) h_{t-1} +
dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, computed for all t at once with
``jax.lax.associative_scan``; the gated RMSNorm ``norm(y * silu(z))``; ``out_proj``.

Compute runs in ``dtype`` (BF16 by default) on FP32 parameters (the master weights); the
scan, norms, softmax and loss run in FP32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

__all__ = ["ModelConfig", "HybridLM", "BLOCK_KINDS"]

BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}


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
    dtype: str = "bfloat16"

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


def _ssm_combine(left, right):
    """Compose two steps of ``h -> a h + b`` (left first)."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


class Mamba2(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c, dt_ = self.cfg, jnp.dtype(self.cfg.dtype)
        b, length, d = x_BxLxD.shape
        inner, n = c.ssm_expand * d, c.ssm_state
        heads, p = inner // c.ssm_head_dim, c.ssm_head_dim
        zxbcdt = _dense(2 * inner + 2 * n + heads, "in_proj", dt_)(x_BxLxD)
        z, xbc, dt = jnp.split(zxbcdt, [inner, 2 * inner + 2 * n], axis=-1)
        # short causal depthwise convolution over time
        w = self.param("conv_kernel", nn.initializers.lecun_normal(), (c.conv_width, xbc.shape[-1]))
        cb = self.param("conv_bias", nn.initializers.zeros, (xbc.shape[-1],))
        padded = jnp.pad(xbc.astype(jnp.float32), ((0, 0), (c.conv_width - 1, 0), (0, 0)))
        xbc = sum(padded[:, k:k + length] * w[k] for k in range(c.conv_width)) + cb
        xbc = jax.nn.silu(xbc)
        xs, bm, cm = jnp.split(xbc, [inner, inner + n], axis=-1)
        # selective scan (float32)
        dt_bias = self.param("dt_bias", lambda k, s: jnp.log(jnp.expm1(
            jnp.exp(jax.random.uniform(k, s, minval=jnp.log(1e-3), maxval=jnp.log(1e-1))))),
            (heads,))
        a_log = self.param("A_log", lambda k, s: jnp.log(jax.random.uniform(
            k, s, minval=1.0, maxval=16.0)), (heads,))
        skip = self.param("D", nn.initializers.ones, (heads,))
        dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)  # (B, L, H)
        decay = jnp.exp(dt * -jnp.exp(a_log))[..., None, None]  # (B, L, H, 1, 1)
        xh = xs.reshape(b, length, heads, p)
        inp = (xh * dt[..., None])[..., None] * bm[:, :, None, None, :]  # (B, L, H, P, N)
        decay = jnp.broadcast_to(decay, inp.shape)
        _, h = jax.lax.associative_scan(_ssm_combine, (decay, inp), axis=1)
        y = jnp.einsum("blhpn,bln->blhp", h, cm) + xh * skip[:, None]
        y = y.reshape(b, length, inner) * jax.nn.silu(z.astype(jnp.float32))
        y = RMSNorm(name="norm")(y).astype(dt_)
        return _dense(d, "out_proj", dt_)(y)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c, dt_ = self.cfg, jnp.dtype(self.cfg.dtype)
        b, length, d = x_BxLxD.shape
        hd = d // c.num_heads
        qkv = _dense(3 * d, "qkv", dt_)(x_BxLxD).reshape(b, length, 3, c.num_heads, hd)
        q, k, v = (qkv[:, :, i].astype(jnp.float32) for i in range(3))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, length, d).astype(dt_)
        return _dense(d, "out", dt_)(o)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        c, dt_ = self.cfg, jnp.dtype(self.cfg.dtype)
        h = _dense(c.mlp_mult * x_BxLxD.shape[-1], "up", dt_)(x_BxLxD)
        return _dense(x_BxLxD.shape[-1], "down", dt_)(jnp.square(jax.nn.relu(h)))


_MIXERS = {"mamba": Mamba2, "attention": Attention, "mlp": MLP}


class Block(nn.Module):
    cfg: ModelConfig
    kind: str

    @nn.compact
    def __call__(self, x):
        h = _MIXERS[self.kind](self.cfg, name=self.kind)(RMSNorm(name="norm")(x))
        return x + h.astype(x.dtype)


class HybridLM(nn.Module):
    """``__call__(tokens_BxL) -> (logits_BxLxV, mtp_logits_BxLxV or None)``, float32 logits.

    ``mtp_logits[:, t]`` predicts token ``t + 2`` from the hidden state at ``t`` and the
    embedding of token ``t + 1`` (the last position sees a zero embedding)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxL):
        c, dt_ = self.cfg, jnp.dtype(self.cfg.dtype)
        embed = nn.Embed(c.vocab, c.d_model, name="embed")
        x = embed(tokens_BxL).astype(jnp.float32)  # the residual stream stays in float32
        for i, letter in enumerate(c.pattern):
            x = Block(c, BLOCK_KINDS[letter], name=f"blocks_{i}")(x)
        final_norm = RMSNorm(name="final_norm")
        head = _dense(c.vocab, "head", dt_)
        logits = head(final_norm(x).astype(dt_)).astype(jnp.float32)
        if not c.mtp:
            return logits, None
        nxt = jnp.pad(embed(tokens_BxL[:, 1:]), ((0, 0), (0, 1), (0, 0)))
        hm = jnp.concatenate([RMSNorm(name="mtp_norm_h")(x), RMSNorm(name="mtp_norm_e")(nxt)],
                             axis=-1).astype(dt_)
        hm = _dense(c.d_model, "mtp_proj", dt_)(hm).astype(jnp.float32)
        hm = Block(c, "mlp", name="mtp_block")(hm)
        mtp_head = _dense(c.vocab, "mtp_head", dt_)
        return logits, mtp_head(final_norm(hm).astype(dt_)).astype(jnp.float32)
