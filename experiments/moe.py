"""Mixture-of-Experts routing for the hybrid LM's ``E`` blocks (``experiments.model.MoE``):
top-k scores, the dropless dispatch into rows sorted by expert (what ``jax.lax.ragged_dot``
takes, and what fp4lab quantizes per expert), the weighted combine, and the load-balancing
loss.

* :func:`route`: ``softmax`` scores (Mixtral, Qwen-MoE) or ``sigmoid`` scores (DeepSeek-V3,
  Nemotron 3), in float32, the top ``k`` experts of each token, and their weights: the
  selected scores normalized to sum to 1 (``norm_topk_prob``, as both families do).
* :func:`dispatch` / :func:`combine`: a token's ``k`` rows sorted (stably) by expert, the
  rows per expert, and the inverse permutation, then the rows weighted and summed back.
* :func:`balance_loss`: Switch Transformer's auxiliary loss ``E * sum_e f_e P_e`` (``f_e``
  the fraction of the ``T * k`` assignments that went to expert ``e``, ``P_e`` the mean of
  its normalized score), 1 when the load is even; :func:`with_aux_loss` adds ``coef`` times
  its gradient to the backward pass without changing the forward or the training loss's
  value, as Megatron-Core's ``MoEAuxLossAutoScaler`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["ROUTER_SCORES", "route", "dispatch", "combine", "balance_loss", "with_aux_loss"]

ROUTER_SCORES = ("softmax", "sigmoid")


def route(logits_TxE, top_k: int, score: str):
    """``(weights_TxK, experts_TxK, probs_TxE)``: each token's ``top_k`` experts by score
    (float32), their weights (the selected scores normalized to sum to 1) and every score
    normalized over the experts (what the balance loss averages)."""
    logits_TxE = logits_TxE.astype(jnp.float32)
    if score == "softmax":
        scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    elif score == "sigmoid":
        scores_TxE = jax.nn.sigmoid(logits_TxE)
    else:
        raise ValueError(f"router score {score!r}: use one of {ROUTER_SCORES}")
    top_TxK, experts_TxK = jax.lax.top_k(scores_TxE, top_k)
    weights_TxK = top_TxK / jnp.sum(top_TxK, axis=-1, keepdims=True)
    probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
    return weights_TxK, experts_TxK, probs_TxE


def dispatch(x_TxD, experts_TxK, num_experts: int):
    """``(rows_RxD, group_sizes_E, order_R)``: each token's row repeated for its ``k``
    experts (``R = T * k``), sorted stably by expert; the rows each expert gets; and the
    permutation (``rows = repeated[order]``)."""
    flat_R = experts_TxK.reshape(-1)
    order_R = jnp.argsort(flat_R, stable=True)
    rows_RxD = jnp.repeat(x_TxD, experts_TxK.shape[-1], axis=0)[order_R]
    sizes_E = jnp.bincount(flat_R, length=num_experts).astype(jnp.int32)
    return rows_RxD, sizes_E, order_R


def combine(y_RxD, order_R, weights_TxK):
    """The experts' rows back in token order, weighted and summed over each token's ``k``."""
    back_RxD = jnp.zeros_like(y_RxD).at[order_R].set(y_RxD)
    y_TxKxD = back_RxD.reshape(weights_TxK.shape + y_RxD.shape[-1:])
    return jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), weights_TxK)


def balance_loss(probs_TxE, experts_TxK):
    """Switch's load-balancing loss ``E * sum_e f_e P_e`` (1 for an even load); its gradient
    reaches the router through ``P_e`` only (``f_e`` counts a discrete choice)."""
    num_experts = probs_TxE.shape[-1]
    counts_E = jnp.bincount(experts_TxK.reshape(-1), length=num_experts)
    f_E = counts_E.astype(jnp.float32) / experts_TxK.size
    return num_experts * jnp.sum(f_E * jnp.mean(probs_TxE, axis=0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def with_aux_loss(x, aux, coef: float):
    """``x``, whose backward pass also sends ``coef`` as the cotangent of ``aux``: training
    then follows ``loss + coef * aux`` (each MoE layer its own term) while the reported loss
    stays the language-model loss."""
    del aux, coef
    return x


def _with_aux_loss_fwd(x, aux, coef):
    return x, jnp.zeros_like(aux)


def _with_aux_loss_bwd(coef, zeros, g):
    return g, zeros + jnp.asarray(coef, zeros.dtype)


with_aux_loss.defvjp(_with_aux_loss_fwd, _with_aux_loss_bwd)
