"""Train the hybrid LM under a precision policy: :func:`train` runs (or resumes) one
experiment in a folder and returns its result; :func:`main` is its command line.

This module owns the run: checks, setup, the loop, checkpoints and resume, Ctrl-C,
divergence, several processes. The pure state, optimizer, loss and step are in
``experiments.step``, the files a run writes in ``experiments.records``, the probe records
in ``experiments.probes``; what a run does and records: docs/experiments.md ("One run").

    python -m experiments.train --config experiments/configs/default.py train.steps=300 \
        precision.policy=nemotron3 --workdir results/runs/nemotron3
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from experiments import policies, runinfo
from experiments.cli import command
from experiments.configs import POLICY_HASH, config_changes, format_changes
from experiments.data import Batch, TextData, load_data
from experiments.memory import check_memory
from experiments.model import HybridLM
from experiments.probes import probe_records, summarize_probes, underflow_by_kind
from experiments.records import RunRecords, read_jsonl
from experiments.runs import read_run_json, restore_checkpoint
from experiments.step import (GradReduce, OutControlSchedule, TrainState, channel_norms_zeros,
                              make_eval, make_optimizer, make_step,
                              model_config)
from fp4lab import osci_reset
from fp4lab.flax import quantize_model
from fp4lab.policy import PrecisionPolicy, policy_to_dict

__all__ = ["train", "main", "initialize_distributed", "check_config", "check_data",
           "resolve_policy", "config_record", "stored_changes", "describe_changes",
           "restore_params", "TrainingDiverged", "TrainingInterrupted", "TrainState",
           "make_optimizer", "make_step", "model_config", "read_jsonl"]


class TrainingDiverged(RuntimeError):
    """The loss or gradient became non-finite; the last good state was saved."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped after a whole step and saved a checkpoint to resume from."""


class _StopOnInterrupt:
    """While active, the first SIGINT (Ctrl-C) only asks the training loop to stop after the
    current step; a second one raises KeyboardInterrupt at once. Outside the main thread
    (where Python cannot take signals) it does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        sys.stderr.write("\nstopping after this step and saving a checkpoint "
                         "(Ctrl-C again to abort now)\n")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# ----------------------------------------------------------------------------- checks


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
    from fp4lab.backend import BACKENDS

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
    if _grad_reduce(config) is not None and config.probes.every:
        raise ValueError(f"train.grad_reduce={t.grad_reduce!r} computes per-replica gradients "
                         "and the probes measure the global step: set probes.every=0")


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
    need = d.seq_len + 2
    if min(data.train.size, data.val.size) <= need:
        raise ValueError(f"data.seq_len={d.seq_len} does not fit the corpus ({data.train.size} "
                         f"train / {data.val.size} validation tokens)")
    check_memory(config, model_config(config, data), n_devices)


def _grad_reduce(config) -> GradReduce | None:
    """``train.grad_reduce``: ``"xla"`` (XLA's all-reduce of the global gradient) or a mode
    of ``fp4lab.reduction`` with per-parameter ``train.grad_reduce_rules``."""
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


# ----------------------------------------------------------------------------- identity


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


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Data parallelism: the batch sharded on a ``data`` mesh axis, the state replicated."""

    devices: list
    batch: NamedSharding
    replicated: NamedSharding

    @classmethod
    def over(cls, devices) -> _Placement:
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
class _Setup:
    """What a run trains: the quantized model (and its all-BF16 twin for the late switch),
    the optimizer, the initial state, the probes' zero inputs (None: no probes), and what its
    config resolved to (``config.json``: :func:`config_record`)."""

    data: TextData
    record: dict
    place: _Placement
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


def _switch_step(t) -> int:
    """The first step of the late precision switch (``train.bf16_last_fraction``): the
    quantized model trains the steps before it."""
    return t.steps - int(round(t.steps * t.bf16_last_fraction))


def _check_outcontrol(config):
    """A policy with OutControl layers: refused with per-replica gradients (its channel norms
    are the global batch's) and where its split would never train (the record window ends
    at or after the last quantized step)."""
    t, o = config.train, config.train.outcontrol
    if _grad_reduce(config) is not None:
        raise ValueError(f"policy {config.precision.policy!r} has OutControl layers, whose "
                         "channel norms are measured on the global batch: train.grad_reduce="
                         f"{t.grad_reduce!r} (per-replica gradients) is not supported with them")
    quantized = _switch_step(t)
    if o.start + o.steps >= quantized:
        raise ValueError(f"train.outcontrol: the channels are chosen after step "
                         f"{o.start + o.steps - 1} (start={o.start}, steps={o.steps}), but "
                         f"the quantized model trains only steps 0-{quantized - 1} "
                         f"(train.steps={t.steps}, bf16_last_fraction={t.bf16_last_fraction}): "
                         f"policy {config.precision.policy!r} would never split")


def _build(config, data: TextData | None) -> _Setup:
    t, d = config.train, config.data
    check_config(config)
    policy = resolve_policy(config)
    if data is None:
        data = load_data(d)
    devices = jax.devices()
    check_data(config, data, len(devices))
    model = HybridLM(model_config(config, data))
    place = _Placement.over(devices)
    tx, sched = make_optimizer(t, num_heads=config.model.num_heads)
    sample = jnp.zeros((d.batch_size, d.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), sample)["params"]
    qmodel = quantize_model(model, policy, backend=config.precision.backend)
    history = qmodel.history_init({"params": params}, sample) or None  # FP8 delayed scaling
    osci = _osci(config, qmodel, params, sample)
    norms = channel_norms_zeros(qmodel, params, sample, history)  # OutControl's, if any
    if norms is not None:
        _check_outcontrol(config)
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1), amax_history=history,
                       osci=None if osci is None else osci_reset.init(
                           [_param(params, p) for p in osci[1]]), channel_norms=norms)
    o = t.outcontrol
    return _Setup(
        data=data, record=config_record(config, data, policy), place=place, qmodel=qmodel,
        osci=osci, outcontrol=None if norms is None else OutControlSchedule(o.start, o.steps),
        bf16_model=quantize_model(model, policies.get("bf16")), tx=tx, sched=sched,
        state=jax.device_put(state, place.replicated),
        probes=qmodel.probe_zeros({"params": params}, sample) if config.probes.every else None,
        params=params, sample=sample)


# ----------------------------------------------------------------------------- files


class _Checkpoints:
    """orbax checkpoints of the TrainState in ``workdir/ckpt`` (the latest two kept)."""

    def __init__(self, workdir: Path):
        import orbax.checkpoint as ocp

        self._ocp, self.dir = ocp, workdir / "ckpt"
        self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, *, force: bool = False, wait: bool = False):
        self.manager.save(step, args=self._ocp.args.StandardSave(state), force=force)
        if wait:
            self.wait()

    def wait(self):
        """Until the saves in flight are on disk."""
        self.manager.wait_until_finished()

    def restore(self, like: TrainState) -> TrainState:
        """The latest checkpoint (damaged files: one line, ``runs.restore_checkpoint``)."""
        abstract = jax.tree.map(self._ocp.utils.to_shape_dtype_struct, like)
        step = self.latest()
        return restore_checkpoint(self.dir.parent, step, lambda: self.manager.restore(
            step, args=self._ocp.args.StandardRestore(abstract)))

    def restore_params(self, like: dict) -> dict:
        """The latest checkpoint's ``TrainState.params`` alone (see :func:`restore_params`)."""
        ocp, device = self._ocp, jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(dtype=a.dtype, sharding=device), like)
        step = self.latest()
        return restore_checkpoint(self.dir.parent, step, lambda: self.manager.restore(
            step, args=ocp.args.PyTreeRestore(item={"params": like}, restore_args={
                "params": args}, partial_restore=True)))["params"]

    def remove_partial(self):
        """What an interrupted save may have left behind."""
        for tmp_dir in self.dir.glob("*orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp_dir, ignore_errors=True)


def restore_params(workdir, like: dict) -> dict:
    """The parameters (``TrainState.params``) of the latest checkpoint of the run in
    ``workdir``, read alone: no optimizer or other state is built or read. ``like`` is their
    tree of shapes and dtypes (``jax.eval_shape`` of the model's init); the arrays come back
    on the default device. FileNotFoundError if ``workdir`` holds no checkpoint."""
    workdir = Path(workdir).resolve()  # orbax reads absolute paths only
    ckpt = _Checkpoints(workdir) if (workdir / "ckpt").is_dir() else None
    if ckpt is None or ckpt.latest() is None:
        raise FileNotFoundError(f"{str(workdir)!r} has no checkpoint to read parameters from")
    return ckpt.restore_params(like)


def _check_resume(workdir: Path, setup: _Setup, policy: str, allow_changes) -> dict:
    """The config changes of a resumed run: refused unless every changed key is allowed (by
    its dotted name or its section, e.g. ``train``)."""
    changes = stored_changes(workdir, setup.record, setup.data) or {}
    allowed = set(allow_changes)
    refused = {k: v for k, v in changes.items()
               if k not in allowed and k.split(".")[0] not in allowed}
    if refused:
        raise ValueError(
            f"{workdir} holds {describe_changes(refused, policy)}; resuming it would blend two "
            "runs. Use another --workdir, remove this one, or continue this run with the new "
            f"values: --allow-changes {','.join(refused)}")
    return changes


def _resume(ckpt: _Checkpoints, records: RunRecords, setup: _Setup, config,
            allow_changes) -> TrainState:
    """The state to start from: the latest checkpoint's (the metrics written after it are
    dropped) or the initial one for a new run; writes ``config.json`` and the changes."""
    start, changes, state = 0, {}, setup.state
    if ckpt.latest() is not None:
        changes = _check_resume(records.out, setup, config.precision.policy, allow_changes)
        state = ckpt.restore(state)
        start = int(state.step)
        records.keep_before(start)
    else:
        records.start_fresh()
    records.write_config(setup.record, start, changes)
    return state


# ----------------------------------------------------------------------------- processes

# How long a process of a multi-process run waits for the others (to start and connect, to
# reach a barrier) before it fails: ``--distributed-timeout``, initialize_distributed().
DISTRIBUTED_TIMEOUT_S = 300
_distributed = {"timeout_s": DISTRIBUTED_TIMEOUT_S, "connected": False, "barriers": 0}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *,
                           timeout_s: float = DISTRIBUTED_TIMEOUT_S):
    """Join the processes of a multi-process run (``jax.distributed.initialize``; the
    arguments not given are auto-detected by JAX) before JAX touches a device, then connect
    their CPU collectives (:func:`_connect_collectives`).

    ``timeout_s`` bounds every wait for a peer that this module controls: the connection
    (``initialization_timeout``: a process that starts late), the exchange of the devices'
    topology when the backend starts, and the barriers of :func:`train` (a peer still
    loading, restoring or compiling). Waits inside a collective are XLA's own (30 minutes
    on CPU, ``--xla_cpu_collective_timeout_seconds``), except gloo's connection of a new
    group of devices (and its reduce-scatter, which no program of a run has), fixed at 30 s
    in this jaxlib (gloo's default context timeout, which XLA does not set): hence the
    connection of the run's groups up front, with every process at the same point."""
    timeout_s = _checked_timeout(timeout_s)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id,
                               initialization_timeout=max(1, math.ceil(timeout_s)))
    # the CPU backend's topology exchange when it starts (next): JAX's defaults are 2 and 5
    # minutes, the global one must be the longer
    minutes = max(1, math.ceil(timeout_s / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", max(2, minutes))
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", max(5, minutes + 1))
    _distributed["timeout_s"] = timeout_s
    _connect_collectives()


def _checked_timeout(timeout_s) -> float:
    """``timeout_s`` as float seconds; ValueError unless positive and finite."""
    t = float(timeout_s)
    if not 0 < t < math.inf:
        raise ValueError(f"the distributed timeout must be a positive number of seconds, "
                         f"not {t:g}")
    return t


def _client():
    """The coordination service's client of ``jax.distributed`` (None without it)."""
    from jax._src import distributed

    return distributed.global_state.client


def _barrier(name: str):
    """Every process waits here for the others, through the coordination service (not a
    collective): up to the distributed timeout, then an error naming the barrier."""
    _distributed["barriers"] += 1  # every process passes the same barriers in the same order
    key = f"experiments.train:{name}:{_distributed['barriers']}"
    _client().wait_at_barrier(key, max(1, int(_distributed["timeout_s"] * 1000)))


def _connect_collectives():
    """Connect the CPU collectives of the groups of devices a multi-process run uses, every
    process at the same point (once per process; one process or another platform: no-op).

    XLA connects gloo's TCP mesh of a group of devices on the first collective that uses it,
    and gloo gives every peer 30 s to arrive (``DEADLINE_EXCEEDED: GetKeyValue() timed
    out``), a limit no option of this jaxlib changes. A peer that reaches its first step
    later than that (compiling on a loaded machine, restoring, process 0 writing the files)
    made the others fail. So each group is connected here by a tiny psum, compiled first and
    run after a barrier (:func:`_barrier`, the distributed timeout), which every process
    leaves together: later collectives on a connected group wait for a late peer as long as
    XLA's collective timeout. The groups: all devices in ``jax.devices()`` order (the run's
    ``data`` mesh, :class:`_Placement`: its steps' and evaluations' all-reduces), and each
    local device's index across the processes (``multihost_utils``' mesh
    ``[processes, local devices]``, which its process_allgather and orbax's barriers use)."""
    if (_distributed["connected"] or jax.process_count() == 1
            or jax.default_backend() != "cpu" or _client() is None):
        return
    devices = np.array(jax.devices())
    programs = []
    for mesh, axis in ((Mesh(devices, ("data",)), "data"),
                       (Mesh(devices.reshape(jax.process_count(), jax.local_device_count()),
                             ("processes", "local")), "processes")):
        spec = P(*mesh.axis_names)
        ones = np.ones(mesh.devices.shape, np.int32)
        x = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, spec),
                                         lambda index, ones=ones: ones[index])
        psum = jax.shard_map(lambda v, axis=axis: jax.lax.psum(v, axis), mesh=mesh, in_specs=spec,
                             out_specs=spec)
        programs.append((jax.jit(psum).lower(x).compile(), x, mesh.shape[axis]))
    _barrier("connect")
    for program, x, size in programs:
        if not all((np.asarray(s.data) == size).all() for s in program(x).addressable_shards):
            raise RuntimeError(f"connecting the CPU collectives: a psum of ones over {size} "
                               "devices did not give the device count")
    _distributed["connected"] = True


def _sync(name: str):
    """The processes of a multi-process run wait here for each other (one: no-op)."""
    if jax.process_count() == 1:
        return
    if _client() is None:  # a cluster without jax.distributed's service
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"experiments.train:{name}")
    else:
        _barrier(name)


def _start_run_info(records: RunRecords, record: dict, start: int) -> dict:
    """``run_info.json`` of this start of the run (a resumed run keeps the earlier starts'
    under ``earlier``, without their config); returns it."""
    earlier = []
    path = records.out / "run_info.json"
    if start and records.write and path.exists():
        old = read_run_json(records.out, "run_info.json")
        earlier = old.pop("earlier", []) + [{k: v for k, v in old.items() if k != "config"}]
    info = runinfo.collect(record, start_step=start, earlier=earlier)
    records.write_run_info(info)
    return info


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class _Interval:
    """The steps since the last throughput measurement: from ``step`` at ``time``."""

    step: int
    time: float
    compiled: bool = False  # it holds a compile: its rate is not training speed


@dataclasses.dataclass
class _StepLog:
    """The step metrics still on the device and the throughput interval they belong to;
    :meth:`flush` fetches them (the loop's only host sync) and writes them."""

    records: RunRecords
    bar: tqdm
    tokens_per_step: int
    interval: _Interval
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)

    def add(self, step: int, metrics: dict):
        self.pending.append((step, metrics))

    def mark(self, step_now: int):
        """Start a new rate interval (the last one held evaluation, probes or a save)."""
        self.interval = _Interval(step_now, time.perf_counter())

    def flush(self, step_now: int) -> bool:
        """Write the pending metrics (steps before ``step_now``); False if there were none."""
        if not self.pending:
            return False
        values = jax.device_get([m for _, m in self.pending])
        now = time.perf_counter()
        rate = ((step_now - self.interval.step) * self.tokens_per_step
                / (now - self.interval.time))
        recs = [{"step": s, **{k: float(x) for k, x in v.items()}}
                for (s, _), v in zip(self.pending, values, strict=True)]
        if not self.interval.compiled:  # the interval's throughput
            recs[-1]["tokens_per_s"] = rate
        self.records.steps(recs)
        self.records.scalar("train/tokens_per_s", rate, step_now)
        self.bar.set_postfix({"loss": f"{recs[-1]['loss']:.4g}", "tok/s": f"{rate:,.0f}"},
                             refresh=False)
        self.bar.update(step_now - self.bar.n)
        self.pending, self.interval = [], _Interval(step_now, now)
        return True


class _Programs:
    """The compiled train steps (per model and probing) and evaluations of one run; a new
    program marks the log's interval (its compile time is not training time). With
    ``probes.fused`` every step of the quantized model computes the probes (one program,
    about 10 % slower per step on CPU); without, a second program probes on probe steps
    only."""

    def __init__(self, config, setup: _Setup, log: _StepLog):
        self.config, self.setup, self.log = config, setup, log
        self._steps, self._evals = {}, {}
        self._val = setup.data.val_batches(config.data.val_batches, config.data.batch_size,
                                           config.data.seq_len)

    def step(self, model, with_probes: bool, phase: str = "plain"):
        k = (id(model), with_probes, phase)
        if k not in self._steps:
            self.log.interval.compiled = True
            self._steps[k] = make_step(model, self.setup.tx, self.setup.sched,
                                       self.config.seed, self.config.train.mtp_weight,
                                       with_probes, _grad_reduce(self.config),
                                       self.setup.place.batch.mesh, self.setup.osci, phase)
        return self._steps[k]

    def evaluate(self, model, state: TrainState, steps_done: int) -> float:
        """Validation loss after ``steps_done`` steps (delayed scaling: with the history the
        next step would use; OutControl: split as the next step would be)."""
        split = self.setup.phase(model, steps_done) == "split"
        k = (id(model), split)
        if k not in self._evals:
            self._evals[k] = make_eval(model, self.config.seed, split)
        f = self._evals[k]
        return float(np.mean([f(state.params, state.amax_history, state.channel_norms,
                                *self.setup.place.put(b)) for b in self._val]))


@dataclasses.dataclass
class _Loop:
    """The training loop of one run, from ``state`` (the resumed one) to ``train.steps``: the
    quantized model until the last ``train.bf16_last_fraction`` of the steps, the all-BF16
    twin after (the late precision switch); a checkpoint every ``train.ckpt_every`` steps and
    at the end."""

    config: object
    setup: _Setup
    ckpt: _Checkpoints
    records: RunRecords
    log: _StepLog
    stop: _StopOnInterrupt
    state: TrainState
    probe_history: list[dict]  # the probe lines so far (those before a resumed step too)

    def __post_init__(self):
        self.programs = _Programs(self.config, self.setup, self.log)
        t = self.config.train
        self.switch = _switch_step(t)

    def model_at(self, step: int):
        return self.setup.qmodel if step < self.switch else self.setup.bf16_model

    def run(self, start: int) -> float:
        """Train the steps from ``start``; returns the final validation loss."""
        for s in range(start, self.config.train.steps):
            self._step(s)
        return self._finish()

    def _step(self, s: int):
        c, model = self.config, self.model_at(s)
        do_probe = bool(c.probes.every) and model is self.setup.qmodel and (
            s % c.probes.every == 0 or s == c.train.steps - 1)
        fn = self.programs.step(model, with_probes=bool(
            self.setup.probes is not None and (c.probes.fused or do_probe)
            and model is self.setup.qmodel), phase=self.setup.phase(model, s))
        b = self.setup.data.batch(c.seed, s, c.data.batch_size, c.data.seq_len)
        self.state, metrics, probe_grads = fn(self.state, *self.setup.place.put(b),
                                              self.setup.probes)
        self.log.add(s, metrics)
        if do_probe:
            self._flush(s + 1)
            rec = {"step": s, "probes": probe_records(jax.device_get(probe_grads))}
            self.probe_history.append(rec)
            self.records.probes(rec)
            self.log.mark(s + 1)  # the probe fetch is not training time
        self._after_step(s, model)

    def _after_step(self, s: int, model):
        """Log, evaluate, checkpoint, and stop on Ctrl-C, as the config says."""
        t, done = self.config.train, s + 1
        if done % t.log_every == 0 or done == t.steps:
            self._flush(done)
        if t.eval_every and done % t.eval_every == 0 and done < t.steps:
            self._flush(done)
            self.records.val_loss(s, self.programs.evaluate(model, self.state, done), done)
            self.log.mark(done)
        if t.ckpt_every and done % t.ckpt_every == 0 and done < t.steps:
            self._flush(done)
            self.ckpt.save(done, self.state)
            self.log.mark(done)
        if done < t.steps and self._stop_requested(done):
            self._flush(done)
            if self.ckpt.latest() != done:
                self.ckpt.save(done, self.state, force=True)
            self.ckpt.wait()
            raise TrainingInterrupted(
                f"{self.config.name}: interrupted after step {done} of {t.steps}; its "
                f"checkpoint is in {self.ckpt.dir}. Run the same command again to "
                "resume (bit-exactly).")

    def _stop_requested(self, done: int) -> bool:
        """Ctrl-C. The processes of a multi-process run must stop after the same step (each
        saves the checkpoint with the others): they agree at log steps, where the loop waits
        for the device anyway; a Ctrl-C that reached any of them stops them all."""
        if jax.process_count() == 1:
            return self.stop.requested
        if done % self.config.train.log_every:
            return False
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.int32(self.stop.requested))))

    def _flush(self, step_now: int):
        """Write the pending metrics, then stop if a step was rejected as non-finite."""
        if not self.log.flush(step_now):
            return
        bad = int(self.state.bad_step)
        if bad >= 0:
            self.ckpt.save(bad, self.state, force=True, wait=True)
            raise TrainingDiverged(
                f"{self.config.name}: the loss or gradient became non-finite at step {bad}; "
                f"saved the last good state (before step {bad}) in {self.ckpt.dir}")

    def _finish(self) -> float:
        steps = self.config.train.steps
        self._flush(steps)
        val_loss = self.programs.evaluate(self.model_at(steps - 1), self.state, steps)
        self.records.val_loss(steps - 1, val_loss, steps)
        if self.ckpt.latest() != steps:  # (a rerun of a finished run restores this one)
            self.ckpt.save(steps, self.state, force=True)
        self.ckpt.wait()
        return val_loss


# ----------------------------------------------------------------------------- the run


_STEP_KEYS = {"step", "loss", "total_loss", "grad_norm", "lr", "tokens_per_s"}


def _result(config, setup: _Setup, records: RunRecords, probe_history: list[dict],
            val_loss: float, started: float) -> dict:
    t, d = config.train, config.data
    steps = records.read("loss")
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    tail = max(1, len(steps) // 10)
    summary = summarize_probes(probe_history)
    return {
        "name": config.name, "policy": config.precision.policy, "status": "ok",
        "policy_sha256": setup.record["precision"]["policy_sha256"],
        "data": setup.data.record(),
        "steps": t.steps, "tokens": t.steps * d.batch_size * d.seq_len,
        "params": int(sum(x.size for x in jax.tree.leaves(setup.params))),
        "final_train_loss": float(np.mean([r["loss"] for r in steps[-tail:]])),
        "val_loss": val_loss,
        "tokens_per_s": float(np.median(rates)) if rates else float("nan"),
        "probes_fused": bool(config.probes.fused and config.probes.every),
        "wall_s": time.perf_counter() - started, "devices": len(setup.place.devices),
        "platform": setup.place.devices[0].platform,
        "underflow_by_kind": underflow_by_kind(summary),
        "probe_summary": summary,
        "layers": {a.path: a.recipe.name if a.recipe else "-"
                   for a in setup.qmodel.explain({"params": setup.params}, setup.sample)},
        "config_changes": records.config_changes(),
        # the mean over the steps of every further per-step metric (mtp_grad_survival, ...)
        "step_metric_means": {k: float(np.mean([r[k] for r in steps if k in r]))
                              for k in sorted({k for r in steps for k in r} - _STEP_KEYS)},
    }


def train(config, workdir, *, data: TextData | None = None, progress: bool = True,
          allow_changes=()) -> dict:
    """Run (or resume) one experiment in ``workdir``; returns the result dict, also written
    atomically to ``workdir/result.json``.

    The config is checked before anything loads (:func:`check_config`, then
    :func:`check_data`); ``data``: the config's data already loaded (a sweep's). A new
    folder starts the run; a folder holding a checkpoint resumes its latest one bit-exactly
    (batches and stochastic-rounding keys are functions of the step; the metrics written
    after the checkpoint are dropped and recomputed), but only if its ``config.json``
    (:func:`config_record`) equals this config's record, except for the keys
    (``"train.steps"``) or sections (``"train"``) in ``allow_changes``, which
    ``config_changes.jsonl`` and the result then record; otherwise ValueError naming the keys
    (:func:`describe_changes`). Every device takes part (data parallelism); in a
    multi-process run (``jax.distributed``) only process 0 writes files and every process
    saves and restores the checkpoints in the shared ``workdir``. A non-finite loss or
    gradient saves the last good state and raises :class:`TrainingDiverged`; Ctrl-C stops
    after the step in progress, saves and raises :class:`TrainingInterrupted`."""
    workdir = Path(workdir).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise NotADirectoryError(f"workdir {str(workdir)!r} is a file: a run's files need a "
                                 "folder (a new one, or the run's to resume it)")
    if config.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(config.compile_cache).resolve()))
    _connect_collectives()  # (jax.distributed initialized by the caller: done here, once)
    setup = _build(config, data)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = _Checkpoints(workdir)
    # process 0 writes the run's files; the others write none and read process 0's
    writer = jax.process_index() == 0
    records = RunRecords(workdir, write=writer)
    if writer:
        ckpt.remove_partial()
    state = _resume(ckpt, records, setup, config, allow_changes)
    start = int(state.step)
    info = _start_run_info(records, setup.record, start)
    _sync("resumed")  # process 0 has rewritten metrics.jsonl for the others to read
    t, d = config.train, config.data
    with (records,
          tqdm(total=t.steps, initial=start, desc=config.name, unit="step",
               disable=not (progress and writer), dynamic_ncols=True) as bar,
          _StopOnInterrupt() as stop):
        log = _StepLog(records, bar, d.batch_size * d.seq_len,
                       _Interval(start, time.perf_counter()))
        started = time.perf_counter()
        loop = _Loop(config, setup, ckpt, records, log, stop, state,
                     probe_history=records.read("probes"))
        val_loss = loop.run(start)
    _sync("finished")  # process 0 has written every metric for the others to read
    result = _result(config, setup, records, loop.probe_history, val_loss, started)
    result["run_info"] = info
    records.write_result(result)
    return result


def _parser(default: str):
    import argparse

    from experiments.configs import keys_help

    ap = argparse.ArgumentParser(
        description="Train the hybrid LM under a precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help(default))
    ap.add_argument("--config", default=default)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--distributed", action="store_true", help="call "
                    "jax.distributed.initialize() first (one process per host, or several "
                    "on one machine); without the next three options JAX detects the cluster "
                    "(SLURM, Open MPI, TPU, JAX_COORDINATOR_ADDRESS, ...)")
    ap.add_argument("--coordinator", metavar="HOST:PORT",
                    help="with --distributed: process 0's address, e.g. 127.0.0.1:12345")
    ap.add_argument("--num-processes", type=int, metavar="N",
                    help="with --distributed: the number of processes")
    ap.add_argument("--process-id", type=int, metavar="I",
                    help="with --distributed: this process's index, 0 to N-1")
    ap.add_argument("--distributed-timeout", type=float, metavar="SECONDS",
                    help="with --distributed: how long a process waits for the others (to "
                         "start and connect, at the run's barriers: a peer still loading or "
                         f"compiling) before it fails; default {DISTRIBUTED_TIMEOUT_S}")
    ap.add_argument("--allow-changes", default="", metavar="KEYS",
                    help="comma-separated config keys or sections (train.steps, train) that "
                         "may differ from the run in --workdir: continue it with the new "
                         "values (recorded in config_changes.jsonl)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300")
    return ap


def _initialize_distributed(args, ap):
    """``--distributed``: join the processes of the run before JAX touches a device
    (:func:`initialize_distributed`; the options not given are auto-detected by JAX; on CPU
    its collectives use gloo)."""
    given = [args.coordinator, args.num_processes, args.process_id, args.distributed_timeout]
    if not args.distributed:
        if any(v is not None for v in given):
            ap.error("--coordinator, --num-processes, --process-id and --distributed-timeout "
                     "need --distributed")
        return
    try:
        timeout_s = _checked_timeout(DISTRIBUTED_TIMEOUT_S if args.distributed_timeout is None
                                     else args.distributed_timeout)
    except ValueError as e:
        ap.error(f"--distributed-timeout: {e}")
    initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                           timeout_s=timeout_s)


@command
def main(argv=None) -> int:
    """``python -m experiments.train``: one run (:func:`train`) of ``--config`` with
    ``key=value`` overrides in ``--workdir``; prints the result. Exit status 0, 130 after
    Ctrl-C (the run saved; the same command resumes it), 2 for a user's mistake
    (``experiments.cli.command``)."""
    from experiments.configs import load_config

    default = str(Path(__file__).parent / "configs" / "default.py")
    ap = _parser(default)
    args = ap.parse_args(argv)
    _initialize_distributed(args, ap)
    config = load_config(args.config, args.overrides)
    allow = tuple(k for k in args.allow_changes.split(",") if k)
    try:
        r = train(config, args.workdir, allow_changes=allow)
    except TrainingInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    if jax.process_index() == 0:
        print(json.dumps({k: v for k, v in r.items()
                          if k not in ("probe_summary", "layers", "run_info")},
                         indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
