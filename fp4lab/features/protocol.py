"""The protocol every stateful training feature follows (:class:`Feature`).

A feature keeps state across training steps, as an optax transformation keeps its optimizer
state: FP8 delayed scaling's amax histories, OutControl's channel statistics, OsciReset's
oscillation counters, and the probes (stateless, but observed the same way). A training
step holds the states as one collection (``{feature.name: state}``) and loops over the
features the run built, each through the same five calls:

* ``build(run)`` (a classmethod): the feature for this run, or ``None`` where no layer uses
  it (from the quantized model's per-GEMM record and the feature's options, the section of
  the run's config named by ``OPTIONS``);
* ``init()``: its state before the first step (``None``: it keeps none);
* ``mode(step, quantized)``: what it does at a step, a string that is static in the compiled
  step (OutControl: ``"plain"``, ``"record"``, ``"split"``);
* ``variables(state, mode, training)``: the Flax collections the step's forward takes from
  it; when ``observes``, the step differentiates the loss with respect to them too, and the
  gradient (``StepContext.observed``) is what the GEMMs observed (the step's amaxes, the
  probes' metrics);
* ``update(state, params, mode, ctx)``: after the optimizer step, its new state (and the
  parameters, which OsciReset resets), metrics to log and a report (the probes' table).

A step whose loss or gradient is not finite keeps every state as it was. A new stateful
feature is one module with a :class:`Feature` subclass (and its field in the recipe, or its
section in the config) plus its line in :data:`fp4lab.features.registry.TRAINING`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax

__all__ = ["Run", "StepContext", "Update", "Feature"]


@dataclasses.dataclass(frozen=True)
class Run:
    """What a feature is built from: the quantized Linen model (``quantize_model``) and its
    policy's name, the initial parameters, a sample input, the feature's options (its config
    section, or ``None``), the run's steps and those the quantized model trains (the first
    ones; a late switch trains the rest in BF16), and the collections of the
    features built before it (a trace of the model may need them: the amax histories)."""

    qmodel: Any
    policy: str
    params: dict
    sample: Any
    options: Any = None
    steps: int = 0
    quantized_steps: int = 0
    collections: dict = dataclasses.field(default_factory=dict)
    # what the features of one run share (``dataclasses.replace`` keeps it): the record
    _shared: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def assignments(self):
        """Every GEMM's path, recipe and stack (``QuantizedLinen.assignments``), traced once
        for all the features of a run."""
        if "assignments" not in self._shared:
            self._shared["assignments"] = self.qmodel.assignments(
                {"params": self.params}, self.sample, rngs={"quant": jax.random.key(0)})
        return self._shared["assignments"]

    @property
    def variables(self) -> dict:
        return {"params": self.params, **self.collections}


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a training step gives each feature's ``update``: the model it trained, the
    parameters and tokens its forward saw, its stochastic-rounding key and step number, the
    collections every feature gave the forward, and the loss's gradient with respect to this
    feature's collections (``observed``; ``{}`` unless it ``observes``)."""

    qmodel: Any
    params: dict
    tokens: jax.Array
    key: jax.Array
    step: jax.Array
    variables: dict
    observed: dict


class Update(NamedTuple):
    """A feature's ``update``: its new state, the parameters (changed or not), scalar metrics
    for the step's log line, and a report for the caller (``None``: nothing this step)."""

    state: Any
    params: dict
    metrics: dict = {}
    report: Any = None


class Feature:
    """A stateful training feature (see the module docstring); the defaults are a feature
    that keeps no state, gives the forward nothing and changes nothing."""

    name: ClassVar[str]  # its key in the train state's collection, its metrics' prefix
    OPTIONS: ClassVar[str | None] = None  # its section of the run's config ("train.outcontrol")
    observes: ClassVar[bool] = False  # the step differentiates the loss w.r.t. its variables

    @classmethod
    def build(cls, run: Run) -> Feature | None:
        raise NotImplementedError

    def init(self) -> Any:
        return None

    def check(self, per_replica: bool) -> None:
        """Refuse a run this feature cannot take part in (``per_replica``: every replica
        differentiates its own rows, ``train.grad_reduce``)."""

    def mode(self, step: int, quantized: bool) -> str:
        return "on"

    def variables(self, state, mode: str, training: bool) -> dict:
        return {}

    def combine_replicas(self, observed: dict, axis: str) -> dict:
        """What the replicas of ``axis`` observed, as the global step would have."""
        return observed

    def update(self, state, params: dict, mode: str, ctx: StepContext) -> Update:
        return Update(state, params)
