"""A run's setup: from its checked specification (:mod:`experiments.run_spec`) to the
quantized model, its all-BF16 twin for the late switch, the optimizer and the initial state
placed on every device (data parallelism), with the stateful recipe features the policy's
layers need (FP8 amax histories, OsciReset, OutControl's channel statistics)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from experiments import policies
from experiments.data import Batch
from experiments.model import HybridLM
from experiments.run_spec import RunSpec, switch_step
from experiments.step import (OutControlSchedule, TrainState, channel_norms_zeros,
                              make_optimizer, model_config)
from fp4lab import osci_reset
from fp4lab.flax import quantize_model

__all__ = ["Placement", "Setup", "build"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Data parallelism: the batch sharded on a ``data`` mesh axis, the state replicated."""

    devices: list
    batch: NamedSharding
    replicated: NamedSharding

    @classmethod
    def over(cls, devices) -> Placement:
        mesh = Mesh(np.array(devices), ("data",))
        return cls(devices, NamedSharding(mesh, P("data")), NamedSharding(mesh, P()))

    def to_global(self, batch_np: np.ndarray) -> jax.Array:
        """The global batch (every process computes the same one: a function of the step)
        as an array sharded over all devices; each process supplies its devices' rows."""
        if jax.process_count() == 1:
            return jax.device_put(batch_np, self.batch)
        return jax.make_array_from_callback(batch_np.shape, self.batch,
                                            lambda index: batch_np[index])

    def put(self, b: Batch) -> tuple[jax.Array, jax.Array]:
        return self.to_global(b.tokens), self.to_global(b.weights)


@dataclasses.dataclass
class Setup:
    """What a run trains: its specification, the quantized model (and its all-BF16 twin for
    the late switch), the optimizer, the initial state and the probes' zero inputs (None: no
    probes)."""

    spec: RunSpec
    place: Placement
    qmodel: object
    bf16_model: object
    tx: object
    sched: object
    state: TrainState
    probes: dict | None
    params: dict  # the initial parameters and a sample batch, for ``qmodel.explain``
    sample: jax.Array
    osci: tuple | None = None  # (OsciReset, the kernel paths it tracks)
    outcontrol: OutControlSchedule | None = None  # when a layer's recipe has OutControl

    def phase(self, model, steps_done: int) -> str:
        """How OutControl's GEMMs run the next step (``"plain"`` without them)."""
        if self.outcontrol is None or model is not self.qmodel:
            return "plain"
        return self.outcontrol.phase(steps_done)


def _param(params: dict, path: str):
    for k in path.split("/"):
        params = params[k]
    return params


def _osci(config, qmodel, params, sample) -> tuple | None:
    """``train.osci_reset``: ``(OsciReset, paths)`` of the kernels whose layer's forward
    weight the policy puts in its format (from the quantized model's record), or None."""
    o = config.train.osci_reset
    if not o.period:
        return None
    cfg = osci_reset.OsciReset(period=o.period, window=o.window, threshold=o.threshold,
                               start=o.start, format=o.format)
    record = qmodel.assignments({"params": params}, sample, rngs={"quant": jax.random.key(0)})
    paths = [f"{a.path}/kernel" for a in record if a.recipe is not None and not a.stack
             and a.recipe.fprop_w.format == cfg.format]
    if not paths:
        raise ValueError(f"train.osci_reset: no layer's forward weight is in format "
                         f"{cfg.format.name} under policy {config.precision.policy!r}")
    return cfg, paths


def _check_outcontrol(spec: RunSpec):
    """A policy with OutControl layers: refused with per-replica gradients (its channel norms
    are the global batch's) and where its split would never train (the record window ends
    at or after the last quantized step)."""
    config = spec.config
    t, o = config.train, config.train.outcontrol
    if spec.grad_reduce is not None:
        raise ValueError(f"policy {config.precision.policy!r} has OutControl layers, whose "
                         "channel norms are measured on the global batch: train.grad_reduce="
                         f"{t.grad_reduce!r} (per-replica gradients) is not supported with them")
    quantized = switch_step(t)
    if o.start + o.steps >= quantized:
        raise ValueError(f"train.outcontrol: the channels are chosen after step "
                         f"{o.start + o.steps - 1} (start={o.start}, steps={o.steps}), but "
                         f"the quantized model trains only steps 0-{quantized - 1} "
                         f"(train.steps={t.steps}, bf16_last_fraction={t.bf16_last_fraction}): "
                         f"policy {config.precision.policy!r} would never split")


def build(spec: RunSpec) -> Setup:
    """The run's model, optimizer and initial state on every device, from its checked
    :class:`~experiments.run_spec.RunSpec`."""
    config, data, policy = spec.config, spec.data, spec.policy
    t, d = config.train, config.data
    devices = jax.devices()
    if len(devices) != spec.n_devices:
        raise ValueError(f"the run was checked for {spec.n_devices} devices; this process "
                         f"sees {len(devices)}")
    model = HybridLM(model_config(config, data))
    place = Placement.over(devices)
    tx, sched = make_optimizer(t, num_heads=config.model.num_heads)
    sample = jnp.zeros((d.batch_size, d.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), sample)["params"]
    qmodel = quantize_model(model, policy, backend=config.precision.backend)
    history = qmodel.history_init({"params": params}, sample) or None  # FP8 delayed scaling
    osci = _osci(config, qmodel, params, sample)
    norms = channel_norms_zeros(qmodel, params, sample, history)  # OutControl's, if any
    if norms is not None:
        _check_outcontrol(spec)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1), amax_history=history,
                       osci=None if osci is None else osci_reset.init(
                           [_param(params, p) for p in osci[1]]), channel_norms=norms)
    o = t.outcontrol
    return Setup(
        spec=spec, place=place, qmodel=qmodel,
        osci=osci, outcontrol=None if norms is None else OutControlSchedule(o.start, o.steps),
        bf16_model=quantize_model(model, policies.get("bf16")), tx=tx, sched=sched,
        state=jax.device_put(state, place.replicated),
        probes=qmodel.probe_zeros({"params": params}, sample) if config.probes.every else None,
        params=params, sample=sample)
