"""The pure parts of training: state, optimizer, loss, and the jitted train and eval steps.

* :class:`TrainState`: step, FP32 master weights, optimizer state, the first non-finite step
  (``bad_step``) and the stateful features' states (:mod:`fp4lab.features.protocol`: FP8
  delayed scaling's amax histories, OsciReset's counters, OutControl's channel norms);
* :func:`make_optimizer` (from ``experiments.optimizers``): AdamW or Muon, with a cosine or
  warmup-stable-decay (WSD) schedule and gradient clipping;
* :func:`make_loss`: cross-entropy (plus the weighted multi-token-prediction loss) of a
  quantized model, with the features' collections as inputs so that the gradients of the
  observed ones are what the GEMMs observed (the probes' metrics, the step's amaxes);
* :func:`make_step`: one jitted step (state donated), no host sync, the features updated in
  a loop; a non-finite loss or gradient leaves the state as it was and records the step in
  ``bad_step``;
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
from fp4lab.features.protocol import StepContext

__all__ = ["TrainState", "GradReduce", "model_config", "make_optimizer", "make_loss",
           "make_grad_fn", "make_step", "make_eval", "feature_variables"]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    bad_step: jax.Array  # -1, or the first step whose loss/gradient was not finite
    # the stateful features' states, {feature.name: state} (fp4lab.features.protocol): FP8
    # delayed scaling's amax histories, OsciReset's counters, OutControl's channel norms
    features: dict = dataclasses.field(default_factory=dict)


def feature_variables(features, states: dict, modes, training: bool = True
                      ) -> tuple[dict, dict]:
    """The collections ``features`` give a forward in ``modes`` (one per feature), as
    ``(observed, fixed)``: the step differentiates the loss with respect to the first."""
    return _partition(features, _given(features, states, modes, training))


def _partition(features, given: list[dict]) -> tuple[dict, dict]:
    observed, fixed = {}, {}
    for f, g in zip(features, given, strict=True):
        (observed if f.observes else fixed).update(g)
    return observed, fixed


def _given(features, states: dict, modes, training: bool) -> list[dict]:
    """Each feature's collections for a forward in ``modes``."""
    return [f.variables(states.get(f.name), mode, training)
            for f, mode in zip(features, modes, strict=True)]


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
    """``loss_fn(params, observed, fixed, tokens, weights, key, counts=None) -> (loss, main
    loss)``; ``observed`` and ``fixed``: the features' collections (:func:`feature_variables`);
    ``counts``: the main and MTP losses' denominators (default: their own token counts, the
    token means)."""
    def loss_fn(params, observed, fixed, tokens, weights, key, counts=(None, None)):
        variables = {"params": params, **fixed, **observed}
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
    (``fp4lab.beyond.reduction``): ``mode`` for every parameter, or the mode of the first
    ``(regex, mode)`` rule whose regex fullmatches the parameter's path (``head/kernel``)."""

    mode: str
    rules: tuple[tuple[str, str], ...] = ()
    # measure, per step, how much of the MTP loss's gradient to the (tied) output layer
    # survives the reduction (fp4lab.beyond.reduction.surviving_fraction; model.mtp_tied_head)
    survival: bool = False

    def __post_init__(self):
        from fp4lab.beyond.reduction import check_mode

        check_mode(self.mode)
        for rule in self.rules:
            if len(rule) != 2:
                raise ValueError(f"train.grad_reduce_rules entry {rule!r}: (regex, mode)")
            re.compile(rule[0])
            check_mode(rule[1])

    def mode_of(self, path: str) -> str:
        return next((m for pattern, m in self.rules if re.fullmatch(pattern, path)), self.mode)


def make_grad_fn(qmodel, mtp_weight: float, reduce: GradReduce | None, mesh=None, *,
                 combine=None, with_local: bool = False):
    """``grads(params, observed, fixed, tokens, weights, key) -> ((loss, main), (grads,
    observed grads), extra metrics[, local grads])``. ``reduce=None``: one global
    ``value_and_grad`` (XLA inserts the all-reduce; no extra metrics). Otherwise every
    replica of ``mesh``'s ``data`` axis differentiates its rows of the batch (its
    stochastic-rounding key folded with its index), and the gradients are reduced explicitly
    with ``reduce``'s modes and divided by the replica count ``N``. A replica's loss divides
    its token-weighted sum by ``W / N``, ``W`` the global token count (of the main and of
    the MTP loss, each), so that the reduced loss and gradients are the global token mean's
    whatever the masks; with equal counts ``W / N`` is the replica's own count, exactly.
    Losses are averaged, the observed collections' gradients combined by ``combine(observed,
    axis)`` (the features': delayed-scaling amaxes maxed); ``reduce.survival`` adds
    ``mtp_grad_survival`` and ``mtp_grad_error`` (two more backward passes of the head).
    ``with_local``: also the replicas' own gradients, stacked (tests)."""
    loss_fn = make_loss(qmodel, mtp_weight)
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    if reduce is None:
        return lambda *args: grad_fn(*args) + ({},)
    return _per_replica_grad_fn(loss_fn, grad_fn, reduce, mesh,
                                combine or (lambda observed, axis: observed), with_local)


def _per_replica_grad_fn(loss_fn, grad_fn, reduce: GradReduce, mesh, combine, with_local: bool):
    """:func:`make_grad_fn` with an explicit reduction: ``grad_fn`` (``loss_fn``'s
    ``value_and_grad``) per replica of ``mesh``'s ``data`` axis under ``shard_map``, the
    gradients reduced with ``reduce``'s modes."""
    from jax.sharding import PartitionSpec as P

    from fp4lab.beyond.reduction import all_reduce

    def local(params, observed, fixed, tokens, weights, key):
        i = jax.lax.axis_index("data")
        n = jax.lax.axis_size("data")
        key = jax.random.fold_in(key, i)
        # this replica's share of the global token counts: W / N (exact for W < 2**24)
        counts = tuple(jnp.maximum(jax.lax.psum(jnp.sum(w), "data"), 1.0) / n
                       for w in _loss_weights(weights))
        (loss, main), (grads, seen) = grad_fn(params, observed, fixed, tokens, weights, key,
                                              counts)
        reduced = jax.tree_util.tree_map_with_path(
            lambda path, g: all_reduce(g, "data", reduce.mode_of(
                jax.tree_util.keystr(path, simple=True, separator="/"))) / n, grads)
        extra = (_mtp_grad_survival(loss_fn, reduce, params, {**fixed, **observed}, tokens,
                                    weights, key, counts) if reduce.survival else {})
        out = ((jax.lax.psum(loss, "data") / n, jax.lax.psum(main, "data") / n),
               (reduced, combine(seen, "data")), extra)
        return out + ((jax.tree.map(lambda g: g[None], grads),) if with_local else ())

    specs = (P(), P(), P(), P("data"), P("data"), P())
    out_specs = ((P(), P()), (P(), P()), P()) + ((P("data"),) if with_local else ())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs,
                         check_vma=False)


def _mtp_grad_survival(loss_fn, reduce: GradReduce, params, variables, tokens, weights, key,
                       counts) -> dict:
    """Inside a replica: the head kernel's gradient parts from the main and the MTP loss,
    gathered over the ``data`` axis, and the share of the MTP part that survives their
    reduction in the head's mode (``mtp_grad_survival``, ``mtp_grad_error``)."""
    from fp4lab.beyond.reduction import surviving_fraction

    def parts(head):
        p = {**params, "head": {**params["head"], "kernel": head}}
        loss, main = loss_fn(p, {}, variables, tokens, weights, key, counts)
        return main, loss - main

    (main, mtp), pull = jax.vjp(parts, params["head"]["kernel"])
    g_main, = pull((jnp.ones_like(main), jnp.zeros_like(mtp)))
    g_mtp, = pull((jnp.zeros_like(main), jnp.ones_like(mtp)))
    stacked = [jax.lax.all_gather(g, "data") for g in (g_main, g_mtp)]
    s = surviving_fraction(*stacked, reduce.mode_of("head/kernel"))
    return {"mtp_grad_survival": s["fraction"], "mtp_grad_error": s["error"]}


def _observed_by(features, given: list[dict], seen: dict) -> list[dict]:
    """Each feature's share of the observed collections' gradients (``{}`` unless it
    observes)."""
    return [{c: seen[c] for c in g} if f.observes else {}
            for f, g in zip(features, given, strict=True)]


def make_step(qmodel, tx, sched, seed: int, mtp_weight: float, features=(), modes=(),
              reduce: GradReduce | None = None, mesh=None):
    """``step(state, tokens, weights) -> (state, metrics, reports)``, jitted with the state
    donated. The SR key of a step is a function of ``seed`` and the step; the seed's key is
    an argument of the compiled program, not a constant in it, so runs that differ only in
    their seed compile the same program (the sweep's seeds share one compile through JAX's
    compilation cache). ``features`` (:mod:`fp4lab.features.protocol`) run in ``modes``
    (one each, static): their collections go into the forward, and after the optimizer step
    each one's ``update`` gives its new state (in ``state.features``), the parameters,
    metrics and a report (``reports``: ``{feature name: report}``). ``reduce``: the explicit
    gradient reduction over ``mesh``'s ``data`` axis (:func:`make_grad_fn`)."""
    features, modes = tuple(features), tuple(modes)
    if len(features) != len(modes):
        raise ValueError(f"make_step: {len(features)} features but {len(modes)} modes")

    def step(state: TrainState, tokens, weights, base_key):
        key = jax.random.fold_in(base_key, state.step)
        given = _given(features, state.features, modes, True)
        observed, fixed = _partition(features, given)

        def combine(seen, axis):  # the replicas' observations, as each feature combines them
            out = {}
            for f, own in zip(features, _observed_by(features, given, seen), strict=True):
                out.update(f.combine_replicas(own, axis) if own else {})
            return out

        grad_fn = make_grad_fn(qmodel, mtp_weight, reduce, mesh, combine=combine)
        (loss, main), (grads, seen), extra = grad_fn(state.params, observed, fixed, tokens,
                                                     weights, key)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        states, metrics, reports = dict(state.features), {}, {}
        variables = {**fixed, **observed}
        for f, mode, own in zip(features, modes, _observed_by(features, given, seen),
                                strict=True):
            u = f.update(states.get(f.name), params, mode, StepContext(
                qmodel, state.params, tokens, key, state.step, variables, own))
            params, metrics = u.params, metrics | u.metrics
            if f.name in states:
                states[f.name] = u.state
            if u.report is not None:
                reports[f.name] = u.report
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & (state.bad_step < 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
        new = TrainState(step=jnp.where(ok, state.step + 1, state.step),
                         params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state),
                         bad_step=jnp.where(ok | (state.bad_step >= 0), state.bad_step,
                                            state.step),
                         features=keep(states, state.features))
        metrics = {"loss": main, "total_loss": loss, "grad_norm": gnorm,
                   "lr": sched(state.step), **extra, **metrics}
        return new, metrics, reports

    return functools.partial(jax.jit(step, donate_argnums=0), base_key=jax.random.key(seed))


def make_eval(qmodel, seed: int):
    """``eval_fn(params, variables, tokens, weights) -> main loss``, jitted; ``variables``:
    the features' collections for evaluation (:func:`feature_variables` with
    ``training=False``: delayed scaling's histories as the next step would use them,
    OutControl's split once chosen; no probes); no MTP term, a fixed SR key, an argument."""
    def main_loss(p, variables, tok, w, key):
        return make_loss(qmodel, 0.0)(p, {}, variables, tok, w, key)[1]

    return functools.partial(jax.jit(main_loss), key=jax.random.key(seed))
