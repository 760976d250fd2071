"""A run's setup: from its checked specification (:mod:`experiments.run_spec`) to the
quantized model, its all-BF16 twin for the late switch, the optimizer and the initial state
placed on every device (data parallelism), with the stateful features the run needs (each
feature of ``fp4lab.features.registry.TRAINING`` that the policy's layers or the config
use: FP8 amax histories, the probes, OutControl's channel statistics, OsciReset), and the
model's own (``MODEL_FEATURES``: the MoE blocks' expert loads and balancing biases)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from experiments import moe, policies
from experiments.data import Batch
from experiments.model import HybridLM
from experiments.run_spec import RunSpec, switch_step
from experiments.step import TrainState, make_optimizer, model_config
from fp4lab.features.protocol import Feature, Run
from fp4lab.features.registry import TRAINING
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
    the late switch), the optimizer, the initial state and the stateful features it built
    (their states are ``state.features``)."""

    spec: RunSpec
    place: Placement
    qmodel: object
    bf16_model: object
    tx: object
    sched: object
    state: TrainState
    params: dict  # the initial parameters and a sample batch, for ``qmodel.explain``
    sample: jax.Array
    features: tuple[Feature, ...] = ()

    def modes(self, model, step: int) -> tuple[str, ...]:
        """What each feature does at ``step`` of ``model`` (the quantized one or the BF16
        twin)."""
        return tuple(f.mode(step, model is self.qmodel) for f in self.features)

    def feature(self, name: str) -> Feature | None:
        return next((f for f in self.features if f.name == name), None)


# the model's own stateful features, after fp4lab's (fp4lab.features.registry.TRAINING)
MODEL_FEATURES = (moe.ExpertLoads,)


def _options(config, path: str | None):
    """The config section at the dotted ``path`` (None: none)."""
    if path is None:
        return None
    for k in path.split("."):
        config = config[k]
    return config


def _features(spec: RunSpec, qmodel, params, sample) -> tuple[Feature, ...]:
    """The features of ``TRAINING`` the run uses, each built with its config section and the
    collections of those before it, each checked against the run's gradient reduction."""
    config, built, collections = spec.config, [], {}
    t = config.train
    run = Run(qmodel, config.precision.policy, params, sample, steps=t.steps,
              quantized_steps=switch_step(t))  # one record of the model for all of them
    for cls in (*TRAINING, *MODEL_FEATURES):
        f = cls.build(dataclasses.replace(run, options=_options(config, cls.OPTIONS),
                                          collections=dict(collections)))
        if f is None:
            continue
        f.check(spec.grad_reduce is not None)
        collections.update(f.variables(f.init(), f.mode(0, True), True))
        built.append(f)
    return tuple(built)


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
    if config.model.moe_bias_rate:
        tx = moe.freeze_router_biases(tx)  # ExpertLoads moves them, not the optimizer
    sample = jnp.zeros((d.batch_size, d.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), sample)["params"]
    qmodel = quantize_model(model, policy, backend=config.precision.backend)
    features = _features(spec, qmodel, params, sample)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1),
                       features={f.name: s for f in features if (s := f.init()) is not None})
    return Setup(spec=spec, place=place, qmodel=qmodel,
                 bf16_model=quantize_model(model, policies.get("bf16")), tx=tx, sched=sched,
                 state=jax.device_put(state, place.replicated), params=params, sample=sample,
                 features=features)
