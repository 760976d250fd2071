"""The pure parts of training: state, optimizer, loss, and the jitted train and eval steps.

* :class:`TrainState`: step, FP32 master weights, optimizer state, the first non-finite step
  (``bad_step``), the FP8 delayed-scaling amax history, OsciReset's state and OutControl's
  summed input-channel norms;
* :func:`make_optimizer` (from ``experiments.optimizers``): AdamW or Muon, with a cosine or
  warmup-stable-decay (WSD) schedule and gradient clipping;
* :func:`make_loss`: cross-entropy (plus the weighted multi-token-prediction loss) of a
  quantized model, with its probes and amax history as inputs so that their gradients are
  the probe metrics and the observed amaxes;
* :func:`make_step`: one jitted step (state donated), no host sync; a non-finite loss or
  gradient leaves the state as it was and records the step in ``bad_step``;
* :func:`make_eval`: the jitted validation loss.

Nothing here touches files, devices or the clock (``experiments.train`` does).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import flax
import jax
import jax.numpy as jnp
import optax

from experiments.model import ModelConfig
from experiments.optimizers import make_optimizer
from fp4lab import delayed, osci_reset, outcontrol

__all__ = ["TrainState", "GradReduce", "model_config", "make_optimizer", "make_loss",
           "make_grad_fn", "make_step", "make_eval", "OutControlSchedule", "channel_norms_zeros",
           "recorded_channel_norms"]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    bad_step: jax.Array  # -1, or the first step whose loss/gradient was not finite
    # FP8 delayed scaling: the "amax_history" collection (None when no layer uses it)
    amax_history: dict | None = None
    # OsciReset's state (fp4lab.osci_reset; None when train.osci_reset is off)
    osci: osci_reset.OsciState | None = None
    # OutControl: the "channel_norms" collection, each GEMM's summed input-channel norms
    # (fp4lab.outcontrol; None when no layer's recipe has OutControl)
    channel_norms: dict | None = None


@dataclasses.dataclass(frozen=True)
class OutControlSchedule:
    """``train.outcontrol``: OutControl's layers sum their input-channel norms over the steps
    ``[start, start + steps)`` and split K from then on (:mod:`fp4lab.outcontrol`)."""

    start: int
    steps: int

    def phase(self, step: int) -> str:
        """``"plain"`` (the recipe without the split), ``"record"`` or ``"split"``."""
        if step < self.start:
            return "plain"
        return "record" if step < self.start + self.steps else "split"


def channel_norms_zeros(qmodel, params, sample, history=None) -> dict | None:
    """The ``"channel_norms"`` collection's first value: zeros of every OutControl GEMM's K
    (its shape from one abstract trace of the model; ``history``: the amax histories of
    delayed-scaling layers, which the trace needs), or None if no GEMM has OutControl. Each
    K is checked against its recipe's channel count here, before any step runs."""
    rngs = {"quant": jax.random.key(0)}
    record = qmodel.assignments({"params": params}, sample, rngs=rngs)
    recipes = {a.path: a.recipe for a in record if a.recipe is not None and a.recipe.outliers}
    if not recipes:
        return None
    variables = {"params": params} | ({} if history is None else {"amax_history": history})
    shapes = jax.eval_shape(lambda v: qmodel.apply(v, sample, rngs=rngs,
                                                   mutable=["channel_norms"])[1], variables)
    shapes = flax.core.unfreeze(shapes["channel_norms"])
    for path, s in flax.traverse_util.flatten_dict(shapes, sep="/").items():
        recipes[path.rsplit("/", 1)[0]].outliers.count(s.shape[0])  # an error naming K
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class _Split:
    """``qmodel`` whose OutControl GEMMs split K by the channel order of ``norms``."""

    def __init__(self, qmodel, norms):
        self.qmodel = qmodel
        self.channels = jax.tree.map(outcontrol.channel_order, norms)

    def apply(self, variables, *args, **kwargs):
        return self.qmodel.apply({**variables, "outlier_channels": self.channels}, *args,
                                 **kwargs)


def recorded_channel_norms(qmodel, params, history, norms, tokens, key):
    """``norms`` plus this step's input-channel norms of every OutControl GEMM (a forward
    pass of the step's own inputs, key and amax histories: the activations it trains on)."""
    variables = {"params": params, "channel_norms": norms}
    if history is not None:
        variables["amax_history"] = history
    _, updates = qmodel.apply(variables, tokens[:, :-1], rngs={"quant": key},
                              mutable=["channel_norms"])
    return flax.core.unfreeze(updates)["channel_norms"]

def model_config(config, data=None) -> ModelConfig:
    """The model a config trains; with its ``data``, the vocabulary covers the data's (a token
    file's ids; bytes: 256), as training builds it."""
    cfg = ModelConfig(**dict(config.model))
    return cfg if data is None else dataclasses.replace(cfg,
                                                        vocab=max(cfg.vocab, data.vocab_size))


def _cross_entropy(logits_BxLxV, targets_BxL, weights_BxL, count=None):
    """The token-weighted sum of the NLL divided by ``count`` (default: these weights' sum,
    at least 1: the token mean)."""
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32))
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    if count is None:
        count = jnp.maximum(jnp.sum(weights_BxL), 1.0)
    return jnp.sum(nll_BxL * weights_BxL) / count


def _loss_weights(weights):
    """The weights of the main loss's and the MTP loss's tokens."""
    return weights, weights[:, 1:]


def make_loss(qmodel, mtp_weight: float):
    """``loss_fn(params, probes, history, tokens, weights, key, counts=None) -> (loss, main
    loss)``; ``counts``: the main and MTP losses' denominators (default: their own token
    counts, the token means)."""
    def loss_fn(params, probes, history, tokens, weights, key, counts=(None, None)):
        variables = {"params": params}
        if probes is not None:
            variables["probes"] = probes
        if history is not None:
            variables["amax_history"] = history
        logits, mtp_logits = qmodel.apply(variables, tokens[:, :-1], rngs={"quant": key})
        main_w, mtp_w = _loss_weights(weights)
        loss = main = _cross_entropy(logits, tokens[:, 1:], main_w, counts[0])
        if mtp_logits is not None:
            loss = loss + mtp_weight * _cross_entropy(mtp_logits[:, :-1], tokens[:, 2:],
                                                      mtp_w, counts[1])
        return loss, main

    return loss_fn


@dataclasses.dataclass(frozen=True)
class GradReduce:
    """``train.grad_reduce``: the data-parallel gradient reduction spelled out per replica
    (``fp4lab.reduction``): ``mode`` for every parameter, or the mode of the first
    ``(regex, mode)`` rule whose regex fullmatches the parameter's path (``head/kernel``)."""

    mode: str
    rules: tuple[tuple[str, str], ...] = ()
    # measure, per step, how much of the MTP loss's gradient to the (tied) output layer
    # survives the reduction (fp4lab.reduction.surviving_fraction; model.mtp_tied_head)
    survival: bool = False

    def __post_init__(self):
        from fp4lab.reduction import check_mode

        check_mode(self.mode)
        for rule in self.rules:
            if len(rule) != 2:
                raise ValueError(f"train.grad_reduce_rules entry {rule!r}: (regex, mode)")
            re.compile(rule[0])
            check_mode(rule[1])

    def mode_of(self, path: str) -> str:
        return next((m for pattern, m in self.rules if re.fullmatch(pattern, path)), self.mode)


def make_grad_fn(qmodel, mtp_weight: float, reduce: GradReduce | None, mesh=None, *,
                 with_local: bool = False):
    """``grads(params, probes, history, tokens, weights, key) -> ((loss, main), (grads,
    probe grads, seen amaxes), extra metrics[, local grads])``. ``reduce=None``: one global
    ``value_and_grad`` (XLA inserts the all-reduce; no extra metrics). Otherwise every
    replica of ``mesh``'s ``data`` axis differentiates its rows of the batch (its
    stochastic-rounding key folded with its index), and the gradients are reduced explicitly
    with ``reduce``'s modes and divided by the replica count ``N``. A replica's loss divides
    its token-weighted sum by ``W / N``, ``W`` the global token count (of the main and of
    the MTP loss, each), so that the reduced loss and gradients are the global token mean's
    whatever the masks; with equal counts ``W / N`` is the replica's own count, exactly.
    Losses are averaged, delayed-scaling amaxes maxed; ``reduce.survival`` adds
    ``mtp_grad_survival`` and ``mtp_grad_error`` (two more backward passes of the head).
    ``with_local``: also the replicas' own gradients, stacked (tests)."""
    loss_fn = make_loss(qmodel, mtp_weight)
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)
    if reduce is None:
        return lambda *args: grad_fn(*args) + ({},)
    return _per_replica_grad_fn(loss_fn, grad_fn, reduce, mesh, with_local)


def _per_replica_grad_fn(loss_fn, grad_fn, reduce: GradReduce, mesh, with_local: bool):
    """:func:`make_grad_fn` with an explicit reduction: ``grad_fn`` (``loss_fn``'s
    ``value_and_grad``) per replica of ``mesh``'s ``data`` axis under ``shard_map``, the
    gradients reduced with ``reduce``'s modes."""
    from jax.sharding import PartitionSpec as P

    from fp4lab.reduction import all_reduce

    def local(params, history, tokens, weights, key):
        i = jax.lax.axis_index("data")
        n = jax.lax.axis_size("data")
        key = jax.random.fold_in(key, i)
        # this replica's share of the global token counts: W / N (exact for W < 2**24)
        counts = tuple(jnp.maximum(jax.lax.psum(jnp.sum(w), "data"), 1.0) / n
                       for w in _loss_weights(weights))
        (loss, main), (grads, _, seen) = grad_fn(params, None, history, tokens, weights, key,
                                                 counts)
        reduced = jax.tree_util.tree_map_with_path(
            lambda path, g: all_reduce(g, "data", reduce.mode_of(
                jax.tree_util.keystr(path, simple=True, separator="/"))) / n, grads)
        seen = None if seen is None else jax.tree.map(lambda a: jax.lax.pmax(a, "data"), seen)
        extra = (_mtp_grad_survival(loss_fn, reduce, params, history, tokens, weights, key,
                                    counts) if reduce.survival else {})
        out = ((jax.lax.psum(loss, "data") / n, jax.lax.psum(main, "data") / n),
               (reduced, None, seen), extra)
        return out + ((jax.tree.map(lambda g: g[None], grads),) if with_local else ())

    specs = (P(), P(), P("data"), P("data"), P())
    out_specs = ((P(), P()), (P(), None, P()), P()) + ((P("data"),) if with_local else ())

    def grads(params, probes, history, tokens, weights, key):
        if probes is not None:
            raise ValueError("train.grad_reduce computes per-replica gradients; the probes "
                             "measure the global step: set probes.every=0")
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs,
                             check_vma=False)(params, history, tokens, weights, key)

    return grads


def _mtp_grad_survival(loss_fn, reduce: GradReduce, params, history, tokens, weights, key,
                       counts) -> dict:
    """Inside a replica: the head kernel's gradient parts from the main and the MTP loss,
    gathered over the ``data`` axis, and the share of the MTP part that survives their
    reduction in the head's mode (``mtp_grad_survival``, ``mtp_grad_error``)."""
    from fp4lab.reduction import surviving_fraction

    def parts(head):
        p = {**params, "head": {**params["head"], "kernel": head}}
        loss, main = loss_fn(p, None, history, tokens, weights, key, counts)
        return main, loss - main

    (main, mtp), pull = jax.vjp(parts, params["head"]["kernel"])
    g_main, = pull((jnp.ones_like(main), jnp.zeros_like(mtp)))
    g_mtp, = pull((jnp.zeros_like(main), jnp.ones_like(mtp)))
    stacked = [jax.lax.all_gather(g, "data") for g in (g_main, g_mtp)]
    s = surviving_fraction(*stacked, reduce.mode_of("head/kernel"))
    return {"mtp_grad_survival": s["fraction"], "mtp_grad_error": s["error"]}


def _osci_reset(osci, params: dict, state, t):
    """OsciReset after the optimizer step ``t`` on the kernels ``osci = (config, paths)``
    names: ``(params, osci state, number reset)``."""
    cfg, paths = osci
    flat = flax.traverse_util.flatten_dict(params, sep="/")
    weights, new, count = osci_reset.step(cfg, [flat[p] for p in paths], state, t)
    flat.update(zip(paths, weights, strict=True))
    return flax.traverse_util.unflatten_dict(flat, sep="/"), new, count


def make_step(qmodel, tx, sched, seed: int, mtp_weight: float, with_probes: bool,
              reduce: GradReduce | None = None, mesh=None, osci=None, phase: str = "plain"):
    """``step(state, tokens, weights, probes) -> (state, metrics, probe gradients)``, jitted
    with the state donated. The SR key of a step is a function of ``seed`` and the step; the
    seed's key is an argument of the compiled program, not a constant in it, so runs that
    differ only in their seed compile the same program (the sweep's seeds share one compile
    through JAX's compilation cache). ``reduce``: the explicit gradient reduction over
    ``mesh``'s ``data`` axis (:func:`make_grad_fn`). ``osci``: ``(OsciReset, kernel
    paths)``, applied after each optimizer step (``state.osci`` holds its state). ``phase``
    (OutControl, :class:`OutControlSchedule`): ``"record"`` adds the step's input-channel
    norms to ``state.channel_norms``, ``"split"`` splits K by their order."""
    if phase not in ("plain", "record", "split"):
        raise ValueError(f"phase={phase!r}: 'plain', 'record' or 'split'")

    def step(state: TrainState, tokens, weights, probes, base_key):
        key = jax.random.fold_in(base_key, state.step)
        model = _Split(qmodel, state.channel_norms) if phase == "split" else qmodel
        grad_fn = make_grad_fn(model, mtp_weight, reduce, mesh)
        (loss, main), (grads, probe_grads, seen), extra = grad_fn(
            state.params, probes if with_probes else None, state.amax_history, tokens,
            weights, key)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        osci_state, resets = state.osci, {}
        if osci is not None:
            params, osci_state, count = _osci_reset(osci, params, state.osci, state.step)
            resets = {"osci_resets": count}
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & (state.bad_step < 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
        history = None if state.amax_history is None else keep(
            delayed.update(state.amax_history, seen), state.amax_history)
        norms = state.channel_norms
        if phase == "record":
            norms = keep(recorded_channel_norms(qmodel, state.params, state.amax_history, norms,
                                                tokens, key), norms)
        new = TrainState(step=jnp.where(ok, state.step + 1, state.step),
                         params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state),
                         bad_step=jnp.where(ok | (state.bad_step >= 0), state.bad_step,
                                            state.step),
                         amax_history=history,
                         osci=None if osci is None else keep(osci_state, state.osci),
                         channel_norms=norms)
        metrics = {"loss": main, "total_loss": loss, "grad_norm": gnorm,
                   "lr": sched(state.step), **extra, **resets}
        return new, metrics, probe_grads

    return functools.partial(jax.jit(step, donate_argnums=0), base_key=jax.random.key(seed))


def make_eval(qmodel, seed: int, split: bool = False):
    """``eval_fn(params, history, channel norms, tokens, weights) -> main loss``, jitted
    (delayed scaling: with the history the next step would use; ``split``: OutControl's GEMMs
    split K by the norms' channel order; no MTP term, a fixed SR key, an argument)."""
    def main_loss(p, h, norms, tok, w, key):
        model = _Split(qmodel, norms) if split else qmodel
        return make_loss(model, 0.0)(p, None, h, tok, w, key)[1]

    return functools.partial(jax.jit(main_loss), key=jax.random.key(seed))
