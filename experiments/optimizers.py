"""The optimizers of a run: AdamW, or Muon with AdamW inside it, and the learning-rate schedule.

``train.optimizer``:

* ``"adamw"``: optax AdamW on every parameter;
* ``"muon"``: ``optax.contrib.muon``: Newton-Schulz-orthogonalized momentum on the hidden 2-D
  matrices (every ``kernel`` inside the blocks and the MTP module's hidden layers), and the
  AdamW that optax runs inside Muon on everything else: the embedding, the output head
  ``head`` and the MTP head ``mtp_head``, norms, biases, the Mamba convolution and decay
  parameters. With ``train.muon.split_qkv_heads`` the fused attention ``qkv`` kernel
  ``[D, 3 H K]`` is orthogonalized per head and per q/k/v, as ``[D, 3, H, K]`` with
  ``MuonDimensionNumbers(reduction_axis=0, output_axis=3)`` (the other axes are batch
  axes), so each head's ``[D, K]`` projection gets its own orthogonal update (Qwen3.8's
  split; the parameter keeps its shape, only the optimizer sees the view).

``train.muon`` holds Muon's own settings: ``ns_steps`` and ``ns_coeffs`` (a preset name of
optax's, ``"standard"`` (Keller Jordan's (3.4445, -4.7750, 2.0315)) or ``"dion"``, a triple,
or one triple per step), ``beta`` and ``nesterov`` of the momentum, ``consistent_rms``
(``0.2``: updates scaled by ``0.2 sqrt(max(fan_in, fan_out))`` so that their RMS matches
AdamW's and AdamW's learning rate and weight decay carry over (Moonshot's Muon); ``None``:
Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``), ``mu_dtype`` (the momentum's dtype:
``None`` for the parameters' FP32, or ``"bfloat16"``) and ``adam_lr_ratio`` (the inner
AdamW's learning rate relative to ``train.lr``). Both optimizers share the schedule,
``train.weight_decay`` (decoupled, multiplied by the learning rate), ``b1``/``b2`` (the inner
AdamW's) and the gradient clipping.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, muon

__all__ = ["make_optimizer", "make_schedule", "muon_partition", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "muon")

# modules outside the blocks whose kernels are not hidden matrices: the inner AdamW's
_ADAMW_MODULES = ("head", "mtp_head")


def make_schedule(t) -> optax.Schedule:
    """The learning-rate schedule of the ``train`` section: cosine or WSD, with warmup."""
    if t.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup, t.steps,
                                                  end_value=t.lr * t.min_lr_ratio)
    if t.schedule == "wsd":
        decay = max(1, int(round(t.steps * t.decay_fraction)))
        stable = max(0, t.steps - t.warmup - decay)
        return optax.join_schedules([
            optax.linear_schedule(0.0, t.lr, t.warmup), optax.constant_schedule(t.lr),
            optax.linear_schedule(t.lr, t.lr * t.min_lr_ratio, decay)],
            [t.warmup, t.warmup + stable])
    raise ValueError(f"train.schedule={t.schedule!r}: use 'cosine' or 'wsd'")


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def muon_partition(params, num_heads: int | None = None) -> dict:
    """The tree of ``params`` with, per leaf, the ``MuonDimensionNumbers`` of a hidden matrix
    (Muon) or ``None`` (the inner AdamW). With ``num_heads``, a ``qkv`` kernel appears as its
    per-head view ``[D, 3, H, K]`` (the leaves of ``params`` must already have that shape:
    :func:`_split_qkv` makes it)."""
    def spec(path, x):
        keys = _keys(path)
        if keys[-1] != "kernel" or keys[0] in _ADAMW_MODULES or x.ndim < 2:
            return None
        if num_heads and keys[-2] == "qkv":
            return MuonDimensionNumbers(reduction_axis=0, output_axis=3)
        return MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    return jax.tree_util.tree_map_with_path(spec, params)


def _split_qkv(tx: optax.GradientTransformation, num_heads: int) -> optax.GradientTransformation:
    """``tx`` seeing every ``qkv`` kernel ``[D, 3 H K]`` as ``[D, 3, H, K]`` (its updates are
    reshaped back); the parameters themselves keep their shape."""
    def view(tree):
        def one(path, x):
            if _keys(path)[-2:] != ("qkv", "kernel"):
                return x
            d, three_hk = x.shape
            if three_hk % (3 * num_heads):
                raise ValueError(f"qkv kernel {x.shape} does not split into 3 x {num_heads} "
                                 "heads")
            return x.reshape(d, 3, num_heads, three_hk // (3 * num_heads))
        return jax.tree_util.tree_map_with_path(one, tree)

    def init(params):
        return tx.init(view(params))

    def update(updates, state, params=None):
        new, state = tx.update(view(updates), state, None if params is None else view(params))
        return jax.tree.map(lambda u, like: u.reshape(like.shape), new, updates), state

    return optax.GradientTransformation(init, update)


def _muon(t, sched, num_heads: int | None) -> optax.GradientTransformation:
    from experiments.configs.default import get_config

    m, known = t.muon, get_config().train.muon  # (a key set by hand, e.g. a typo: refused)
    unknown = sorted(set(m) - set(known))
    if unknown:
        raise ValueError(f"train.muon has unknown keys {unknown}; known: {', '.join(known)}")
    coeffs = m["ns_coeffs"]
    if not isinstance(coeffs, str):
        shape = np.shape(coeffs)
        if len(shape) not in (1, 2) or shape[-1] != 3:
            raise ValueError(f"train.muon.ns_coeffs={coeffs!r}: a preset name ('standard', "
                             "'dion'), three coefficients, or three per Newton-Schulz step")
        coeffs = tuple(coeffs) if len(shape) == 1 else tuple(tuple(c) for c in coeffs)
    if not isinstance(m["ns_steps"], int) or m["ns_steps"] < 1:
        raise ValueError(f"train.muon.ns_steps={m['ns_steps']!r} must be an int >= 1")
    heads = num_heads if m["split_qkv_heads"] else None
    ratio = float(m["adam_lr_ratio"])
    tx = muon(sched, ns_coeffs=coeffs, ns_steps=m["ns_steps"], beta=m["beta"],
              nesterov=m["nesterov"], weight_decay=t.weight_decay, mu_dtype=m["mu_dtype"],
              adam_b1=t.b1, adam_b2=t.b2, adam_weight_decay=t.weight_decay,
              adam_learning_rate=(lambda step: ratio * sched(step)) if ratio != 1 else None,
              muon_weight_dimension_numbers=lambda p: muon_partition(p, heads),
              consistent_rms=m["consistent_rms"])
    return _split_qkv(tx, heads) if heads else tx


def make_optimizer(t, num_heads: int | None = None) -> tuple[optax.GradientTransformation,
                                                             optax.Schedule]:
    """The optimizer (gradient clipping, then ``train.optimizer``) and its learning-rate
    schedule from the ``train`` section of a config; ``num_heads``: attention's, for Muon's
    per-head ``qkv`` split."""
    sched = make_schedule(t)
    name = t.optimizer
    if name == "adamw":
        opt = optax.adamw(sched, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay)
    elif name == "muon":
        opt = _muon(t, sched, num_heads)
    else:
        raise ValueError(f"train.optimizer={name!r}: use one of {', '.join(OPTIMIZERS)}")
    return optax.chain(optax.clip_by_global_norm(t.clip), opt), sched
