"""A run's specification: its config checked once, and what it resolves to.

:func:`specify` refuses a config no run can train before anything is loaded or compiled
(:func:`check_config`, :func:`check_data`), resolves its policy and data, and returns a
frozen :class:`RunSpec`, the one value ``experiments.train.train`` and the setup read; the
sweep's plan check builds one per run before any trains. Identity: what a run's
``config.json`` holds (:func:`config_record`) and how a stored run differs from it
(:func:`stored_changes`, :func:`describe_changes`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import policies
from experiments.configs import POLICY_HASH, config_changes, format_changes
from experiments.data import TextData, load_data
from experiments.memory import check_memory
from experiments.run_files import read_run_json
from experiments.step import GradReduce, make_optimizer, model_config
from fp4lab.policy import PrecisionPolicy, policy_to_dict

__all__ = ["RunSpec", "specify", "check_config", "check_data", "grad_reduce", "switch_step",
           "resolve_policy", "config_record", "stored_changes", "describe_changes"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run, checked and resolved once (:func:`specify`): its ``config`` (not to be
    changed afterwards), its ``data``, its ``policy``, the ``record`` its ``config.json``
    holds (:func:`config_record`), its gradient reduction (None: XLA's all-reduce) and the
    device count it was checked for."""

    config: object
    data: TextData
    policy: PrecisionPolicy
    record: dict
    grad_reduce: GradReduce | None
    n_devices: int


def specify(config, data: TextData | None = None, n_devices: int | None = None, *,
            load=None) -> RunSpec:
    """Check ``config`` (before anything loads), resolve its policy, load its data (unless
    given) with ``load`` (default :func:`experiments.data.load_data`; a sweep's loads each
    data section once) and check what it asks of the data and the ``n_devices`` (default:
    every device)."""
    check_config(config)
    policy = resolve_policy(config)
    if data is None:
        data = (load or load_data)(config.data)
    n = jax.device_count() if n_devices is None else n_devices
    check_data(config, data, n)
    return RunSpec(config=config, data=data, policy=policy,
                   record=config_record(config, data, policy), grad_reduce=grad_reduce(config),
                   n_devices=n)


# the least value of every count and size a run needs (0: the feature can be off)
_LEAST = {"data.batch_size": 1, "data.seq_len": 1, "data.val_batches": 1, "train.steps": 1,
          "train.warmup": 0, "train.log_every": 1, "train.eval_every": 0,
          "train.ckpt_every": 0, "probes.every": 0, "model.d_model": 1, "model.vocab": 1,
          "model.num_heads": 1, "model.mlp_mult": 1, "model.ssm_expand": 1,
          "model.ssm_head_dim": 1, "model.ssm_state": 1, "model.conv_width": 1,
          "train.outcontrol.start": 0, "train.outcontrol.steps": 1}
# the real numbers of a run and the interval each must be in
_RANGES = {"train.lr": ("(0, inf)", lambda v: 0 < v < math.inf),
           "train.clip": ("[0, inf)", lambda v: 0 <= v < math.inf),
           "train.weight_decay": ("[0, inf)", lambda v: 0 <= v < math.inf),
           "train.mtp_weight": ("[0, inf)", lambda v: 0 <= v < math.inf),
           "train.min_lr_ratio": ("[0, 1]", lambda v: 0 <= v <= 1),
           "train.decay_fraction": ("[0, 1]", lambda v: 0 <= v <= 1),
           "train.bf16_last_fraction": ("[0, 1]", lambda v: 0 <= v <= 1),
           "data.val_fraction": ("(0, 1)", lambda v: 0 < v < 1)}


def _values(config, keys):
    """``(key, value)`` of each dotted key (``section.name``, ``section.sub.name``)."""
    for key in keys:
        node = config
        for part in key.split("."):
            node = node[part]
        yield key, node


def check_config(config):
    """Refuse a config no run can train, before anything is loaded or compiled: a count or
    size out of range (``data.batch_size=0`` would train on nothing and report a loss of 0),
    a number outside its interval, an unknown backend, optimizer or reduction."""
    from fp4lab.numerics.backend import BACKENDS

    for key, v in _values(config, _LEAST):
        if isinstance(v, bool) or not isinstance(v, int) or v < _LEAST[key]:
            raise ValueError(f"{key}={v!r} must be an integer >= {_LEAST[key]}")
    for key, v in _values(config, _RANGES):
        interval, ok = _RANGES[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ValueError(f"{key}={v!r} must be a number in {interval}")
    t = config.train
    if t.warmup >= t.steps:
        raise ValueError(f"train.warmup={t.warmup} must be below train.steps={t.steps}")
    try:
        jnp.dtype(config.model.dtype)
    except TypeError:
        raise ValueError(f"model.dtype={config.model.dtype!r} is not a dtype name (bfloat16, "
                         "float32, ...)") from None
    backend = config.precision.backend
    if backend not in BACKENDS:
        raise ValueError(f"precision.backend={backend!r}: use one of {', '.join(BACKENDS)}")
    make_optimizer(t, num_heads=config.model.num_heads)  # the optimizer and schedule names
    if grad_reduce(config) is not None and config.probes.every:
        raise ValueError(f"train.grad_reduce={t.grad_reduce!r} computes per-replica gradients "
                         "and the probes measure the global step: set probes.every=0")
    if config.model.moe_parallel and (grad_reduce(config) is not None or config.probes.every):
        raise ValueError("model.moe_parallel=True (expert parallelism) runs with XLA's "
                         "gradient all-reduce and no probes (an expert stack's probe spans "
                         f"every device): it has train.grad_reduce={t.grad_reduce!r}, "
                         f"probes.every={config.probes.every}")


def check_data(config, data: TextData, n_devices: int):
    """What the config asks of the data and the devices: ValueError if ``data.batch_size``
    does not split over ``n_devices``, a split of ``data`` holds no more than
    ``data.seq_len + 2`` tokens, or the training step would need more memory than the
    machine has (an estimate: :func:`experiments.memory.check_memory`), before the model is
    initialized or compiled."""
    d = config.data
    if d.batch_size % n_devices:
        raise ValueError(f"data.batch_size={d.batch_size} is not divisible by the "
                         f"{n_devices} devices (data parallelism splits the batch)")
    if config.model.moe_parallel and config.model.moe_experts % n_devices:
        raise ValueError(f"model.moe_experts={config.model.moe_experts} is not divisible by "
                         f"the {n_devices} devices (model.moe_parallel splits the experts)")
    need = d.seq_len + 2
    if min(data.train.size, data.val.size) <= need:
        raise ValueError(f"data.seq_len={d.seq_len} does not fit the corpus ({data.train.size} "
                         f"train / {data.val.size} validation tokens)")
    check_memory(config, model_config(config, data), n_devices)


def grad_reduce(config) -> GradReduce | None:
    """``train.grad_reduce``: ``"xla"`` (XLA's all-reduce of the global gradient) or a mode
    of ``fp4lab.beyond.reduction`` with per-parameter ``train.grad_reduce_rules``."""
    t = config.train
    mode, survival = t.grad_reduce, bool(t.grad_survival)
    if mode == "xla":
        if t.grad_reduce_rules or survival:
            raise ValueError("train.grad_reduce_rules and train.grad_survival need "
                             "train.grad_reduce set to a mode (fp32, bf16_wire, bf16_ring, "
                             "bf16_tree), not 'xla'")
        return None
    if survival and not (config.model.mtp and config.model.mtp_tied_head):
        raise ValueError("train.grad_survival measures the MTP loss's share of the shared "
                         "output layer's gradient: it needs model.mtp=True and "
                         "model.mtp_tied_head=True")
    return GradReduce(mode, tuple(tuple(r) for r in t.grad_reduce_rules), survival)


def resolve_policy(config) -> PrecisionPolicy:
    """The config's precision policy. A config read back from a run's ``config.json`` (which
    holds the policy's hash) must still resolve to the policy the run trained under."""
    policy = policies.get(config.precision.policy)
    # (a fresh config has no hash: only config_record adds it)
    then, now = config.precision.get("policy_sha256"), policies.fingerprint(policy)
    if then and then != now:
        raise ValueError(f"run {config.name!r} was "
                         f"{_policy_changed(config.precision.policy, then, now)}; the rules it "
                         "trained under are in its config.json (precision.policy_rules)")
    return policy


def config_record(config, data: TextData, policy: PrecisionPolicy) -> dict:
    """What a run's ``config.json`` holds: the config with what it resolved to, the model's
    vocabulary (``model.vocab``: the data's when that is larger) and the policy's rules
    (``precision.policy_rules``) and their hash (``precision.policy_sha256``, what identifies
    the policy: :func:`experiments.policies.fingerprint`)."""
    record = config.to_dict()
    record["model"]["vocab"] = model_config(config, data).vocab
    record["precision"].update(policy_sha256=policies.fingerprint(policy),
                               policy_rules=policy_to_dict(policy))
    return record


def stored_changes(workdir, record: dict, data: TextData) -> dict[str, tuple] | None:
    """The config changes from the run stored in ``workdir`` (its ``config.json``) to
    ``record`` (:func:`config_record`); None if no run is stored there.

    A run stored before runs recorded what their config resolved to (no policy hash) had the
    config's ``model.vocab`` (its model had the data's when larger) and, under a named
    policy, is taken to have had that name's rules (they are the code's); a ``file:``
    policy's content then cannot be known: the hash differs from any, and the run is refused
    (docs/experiments.md)."""
    path = Path(workdir) / "config.json"
    if not path.exists():
        return None
    stored = read_run_json(workdir, "config.json")  # damaged: one line naming it
    precision, model = stored["precision"], stored["model"]
    if "policy_sha256" not in precision:
        model["vocab"] = max(model["vocab"], data.vocab_size)
        if not precision["policy"].startswith("file:"):
            precision["policy_sha256"] = record["precision"]["policy_sha256"]
    return config_changes(stored, record)


def describe_changes(changes: dict[str, tuple], policy: str) -> str:
    """``a run with another config (train.steps: 6 -> 8)`` and/or what its policy said."""
    rest = {k: v for k, v in changes.items() if k != POLICY_HASH}
    parts = [f"a run with another config ({format_changes(rest)})"] if rest else []
    if POLICY_HASH in changes:
        parts.append(f"a run {_policy_changed(policy, *changes[POLICY_HASH])}")
    return " and ".join(parts)


def _policy_changed(name: str, then: str | None, now: str) -> str:
    what = f"policy file {name[5:]!r}" if name.startswith("file:") else f"policy {name!r}"
    if then is None:
        return (f"stored before runs recorded their policy's content: whether {what} has "
                "changed since it trained cannot be told")
    return (f"trained under {what} as it read then, and it has changed since (sha256 "
            f"{then[:12]}... then, {now[:12]}... now)")


def switch_step(t) -> int:
    """The first step of the late precision switch (``train.bf16_last_fraction``): the
    quantized model trains the steps before it."""
    return t.steps - int(round(t.steps * t.bf16_last_fraction))
