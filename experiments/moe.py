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
* :class:`ExpertLoads`: each MoE block's loads, observed from every training step's forward
  (through :func:`observe_load`, summed over the replicas) and logged, and DeepSeek-V3's
  auxiliary-loss-free balancing by them: each block's ``router_bias`` (one float32 per
  expert) is added to the scores for the choice of experts only, and after each step the
  trainer moves it by ``model.moe_bias_rate`` towards the mean load, ``b_e += rate *
  sign(mean_load - load_e)`` (Megatron-Core's ``get_updated_expert_bias``); the optimizer
  leaves it alone (:func:`freeze_router_biases`).
* :func:`expert_parallel`: the experts over the devices of a mesh axis, with all-to-all
  dispatch (optionally quantized: ``fp4lab.beyond.dispatch``) and return; each expert sees
  the one-device layer's rows in the same order; :func:`experts_over_devices` runs it under
  ``jax.shard_map`` over every device, the expert stacks split over them (the hybrid LM's
  ``moe_parallel``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fp4lab.features.protocol import Feature, Run, StepContext, Update

__all__ = ["ROUTER_SCORES", "route", "dispatch", "combine", "balance_loss", "with_aux_loss",
           "BIAS", "LOADS", "expert_load", "observe_load", "ExpertLoads", "expert_parallel",
           "experts_over_devices", "freeze_router_biases", "EXPERT_AXIS"]

ROUTER_SCORES = ("softmax", "sigmoid")
BIAS = "router_bias"  # an MoE block's parameter of per-expert routing biases
LOADS = "expert_load"  # the collection through which the trainer observes the loads
# the mesh axis the experts split over: the trainer's data axis (experiments.setup.Placement),
# as expert parallelism shares the data-parallel devices
EXPERT_AXIS = "data"


def route(logits_TxE, top_k: int, score: str, bias_E=None):
    """``(weights_TxK, experts_TxK, probs_TxE)``: each token's ``top_k`` experts by score
    (float32; by score plus ``bias_E`` where given, DeepSeek-V3's balancing bias, which
    chooses but does not weigh), their weights (the selected unbiased scores normalized to
    sum to 1) and every score normalized over the experts (what the balance loss
    averages)."""
    logits_TxE = logits_TxE.astype(jnp.float32)
    if score == "softmax":
        scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    elif score == "sigmoid":
        scores_TxE = jax.nn.sigmoid(logits_TxE)
    else:
        raise ValueError(f"router score {score!r}: use one of {ROUTER_SCORES}")
    if bias_E is None:
        top_TxK, experts_TxK = jax.lax.top_k(scores_TxE, top_k)
    else:
        _, experts_TxK = jax.lax.top_k(scores_TxE + jax.lax.stop_gradient(bias_E), top_k)
        top_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
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


def expert_load(experts_TxK, num_experts: int):
    """The assignments each expert got (float32, ``(num_experts,)``)."""
    return jnp.bincount(experts_TxK.reshape(-1), length=num_experts).astype(jnp.float32)


@jax.custom_vjp
def observe_load(x, probe_E, load_E):
    """``x``, whose backward pass gives ``load_E`` as the cotangent of ``probe_E`` (zeros
    the trainer passes in a collection and differentiates the loss against, as the GEMM
    probes do): the step learns each MoE block's loads from its one forward."""
    del probe_E, load_E
    return x


def _observe_load_fwd(x, probe_E, load_E):
    return x, load_E


def _observe_load_bwd(load_E, g):
    return g, load_E, jnp.zeros_like(load_E)


observe_load.defvjp(_observe_load_fwd, _observe_load_bwd)


def _moe_blocks(params: dict) -> list[tuple[str, ...]]:
    """The paths of the MoE blocks (``.../moe``: the modules holding a ``router``)."""
    return [path[:-2] for path in traverse_util.flatten_dict(params)
            if path[-2:] == ("router", "kernel")]


def freeze_router_biases(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` for every parameter but the routers' biases, which it leaves as they are (no
    weight decay, no update): :class:`ExpertLoads` moves them."""
    def labels(params):
        return traverse_util.unflatten_dict({
            path: "fixed" if path[-1] == BIAS else "trained"
            for path in traverse_util.flatten_dict(params)})

    return optax.multi_transform({"trained": tx, "fixed": optax.set_to_zero()}, labels)


class ExpertLoads(Feature):
    """Every MoE block's expert loads, observed from each training step's forward, and,
    where ``moe_bias_rate`` > 0, DeepSeek-V3's auxiliary-loss-free balancing by them (the
    module docstring). It keeps no state of its own: the biases are parameters, so that
    evaluation, analyses, checkpoints and exports route as training did. Each step's
    metrics: ``moe_load_max`` and ``moe_load_min``, the most and the least loaded expert's
    share of its block's assignments over the even share ``1 / experts``, averaged over the
    blocks (a rarely routed expert shows as a low ``moe_load_min``)."""

    name = "expert_loads"
    OPTIONS = "model"
    observes = True

    def __init__(self, rate: float, blocks: list[tuple[str, ...]], experts: int):
        self.rate, self.blocks, self.experts = rate, blocks, experts

    @classmethod
    def build(cls, run: Run) -> ExpertLoads | None:
        blocks = _moe_blocks(run.params)
        if not blocks:
            return None
        return cls(float(run.options.moe_bias_rate), blocks, int(run.options.moe_experts))

    def variables(self, state, mode: str, training: bool) -> dict:
        if not training:
            return {}
        zeros = {path + ("load",): jnp.zeros(self.experts, jnp.float32)
                 for path in self.blocks}
        return {LOADS: traverse_util.unflatten_dict(zeros)}

    def combine_replicas(self, observed: dict, axis: str) -> dict:
        return jax.tree.map(lambda a: jax.lax.psum(a, axis), observed)

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        flat = traverse_util.flatten_dict(params)
        loads = traverse_util.flatten_dict(ctx.observed[LOADS])
        most, least = [], []
        for path in self.blocks:
            load_E = loads[path + ("load",)]
            if self.rate:
                flat[path + (BIAS,)] = flat[path + (BIAS,)] + self.rate * jnp.sign(
                    jnp.mean(load_E) - load_E)
            even = jnp.maximum(jnp.mean(load_E), 1.0)
            most.append(jnp.max(load_E) / even)
            least.append(jnp.min(load_E) / even)
        return Update(state, traverse_util.unflatten_dict(flat) if self.rate else params,
                      {"moe_load_max": jnp.mean(jnp.stack(most)),
                       "moe_load_min": jnp.mean(jnp.stack(least))})


def expert_parallel(x_TxD, experts_TxK, weights_TxK, expert_fn, num_experts: int, axis,
                    dispatch_format=None):
    """An MoE layer's experts across the devices of mesh axis ``axis`` (called inside
    ``jax.shard_map``): each device holds ``T`` of the tokens (their top-k ``experts_TxK``
    and ``weights_TxK`` from its own routing) and ``num_experts / P`` of the experts, device
    ``p`` the ``p``-th run of them; ``expert_fn(rows, sizes)`` computes this device's
    experts on rows sorted by expert (``sizes`` per local expert; rows after their sum are
    padding, which it must map to zeros, as ``ragged_dot`` does).

    Dropless: each device sends every row to the device of its expert in one all-to-all of
    ``(P, T * k, D)`` slots (the rows for device ``q`` first in slot ``q``, sorted by
    expert), quantized to ``dispatch_format`` (None: as they are; ``fp4lab.beyond.dispatch``:
    MXFP8 forward, the backward unquantized), and the row counts in a second; the receiver
    orders what it got by local expert, then by source device, which is the global token
    order when the tokens are split over the devices in order, so each expert sees the rows
    of the one-device layer in the same order. The outputs go back by a third all-to-all (in
    their own dtype) and are combined with the routing weights."""
    from fp4lab.beyond import dispatch as comm

    P = jax.lax.axis_size(axis)
    if num_experts % P:
        raise ValueError(f"{num_experts} experts do not split over {P} devices of axis "
                         f"{axis!r}")
    local = num_experts // P
    tokens, k = experts_TxK.shape
    R = tokens * k
    rows_RxD, sizes_E, order_R = dispatch(x_TxD, experts_TxK, num_experts)
    dest_R = experts_TxK.reshape(-1)[order_R] // local
    per_dest_P = sizes_E.reshape(P, local).sum(axis=1)
    slot_R = jnp.arange(R, dtype=jnp.int32) - (jnp.cumsum(per_dest_P) - per_dest_P)[dest_R]
    send_PxRxD = jnp.zeros((P, R) + x_TxD.shape[1:], x_TxD.dtype).at[dest_R, slot_R].set(
        rows_RxD)
    recv_PxRxD = comm.all_to_all(send_PxRxD, axis, dispatch_format)
    counts_PxL = jax.lax.all_to_all(sizes_E.reshape(P, local), axis, 0, 0)  # [source, expert]

    sizes_L = counts_PxL.sum(axis=0)
    ends_PxL = jnp.cumsum(counts_PxL, axis=1)
    j_R = jnp.arange(R, dtype=jnp.int32)
    expert_PxR = jnp.minimum(jax.vmap(lambda e: jnp.searchsorted(e, j_R, side="right"))(
        ends_PxL), local - 1)
    earlier_PxL = jnp.cumsum(counts_PxL, axis=0) - counts_PxL  # from sources before
    first_PxL = (jnp.cumsum(sizes_L) - sizes_L)[None] + earlier_PxL - (ends_PxL - counts_PxL)
    valid_PxR = j_R[None] < ends_PxL[:, -1:]
    target_PxR = jnp.where(valid_PxR, jnp.take_along_axis(first_PxL, expert_PxR, 1) + j_R,
                           P * R)
    rows_MxD = jnp.zeros((P * R,) + x_TxD.shape[1:], x_TxD.dtype).at[
        target_PxR.reshape(-1)].set(recv_PxRxD.reshape((P * R,) + x_TxD.shape[1:]),
                                    mode="drop")
    y_MxN = expert_fn(rows_MxD, sizes_L)
    back_PxRxN = jnp.where(valid_PxR[..., None], y_MxN[jnp.minimum(target_PxR, P * R - 1)], 0)
    home_PxRxN = jax.lax.all_to_all(back_PxRxN, axis, 0, 0)
    return combine(home_PxRxN[dest_R, slot_R], order_R, weights_TxK)


def experts_over_devices(x_TxD, experts_TxK, weights_TxK, stacks, expert_fn_of,
                         num_experts: int, dispatch_format=None):
    """:func:`expert_parallel` over every device (mesh axis :data:`EXPERT_AXIS`, the
    devices in ``jax.devices()`` order, as the trainer's data parallelism lays them out),
    under ``jax.shard_map``: the tokens (``x_TxD`` and their routing) and each expert stack
    in ``stacks`` (leading axis: the experts) split over the devices in order;
    ``expert_fn_of(*local_stacks)`` gives the ``expert_fn`` of a device's experts. Its
    ``jax.lax.ragged_dot`` calls run under :func:`fp4lab.flax.experts_split_over`, so a
    policy quantizes each expert as on one device."""
    from fp4lab.flax import experts_split_over

    def local(x, experts, weights, *local_stacks):
        with experts_split_over(EXPERT_AXIS):
            return expert_parallel(x, experts, weights, expert_fn_of(*local_stacks),
                                   num_experts, EXPERT_AXIS, dispatch_format)

    devices = jax.devices()
    for what, n in (("tokens", x_TxD.shape[0]), ("experts", num_experts)):
        if n % len(devices):
            raise ValueError(f"expert parallelism: {n} {what} do not split over "
                             f"{len(devices)} devices")
    mesh, split = Mesh(np.array(devices), (EXPERT_AXIS,)), P(EXPERT_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(split,) * (3 + len(stacks)),
                         out_specs=split)(x_TxD, experts_TxK, weights_TxK, *stacks)
