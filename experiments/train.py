"""Train the hybrid LM under a precision policy, with numerics probes, checkpoints and resume.

``train(config, workdir)`` runs one experiment and returns its result (also written atomically
to ``workdir/result.json``). What it does:

* optax AdamW with a cosine or warmup-stable-decay (WSD) schedule and gradient clipping; FP32
  master weights, BF16 compute (the model's ``dtype``); the policy quantizes every GEMM;
* one jitted step (state donated) with no host sync: metrics stay on the device until the next
  log step, when they are fetched together;
* data-parallel over all devices (the batch is sharded on a ``data`` mesh axis, the state
  replicated; XLA inserts the gradient all-reduce); on several hosts run one process per host
  with ``--distributed`` (``jax.distributed.initialize()``): every process computes the same
  global batch and supplies its own devices' rows;
* orbax checkpoints every ``train.ckpt_every`` steps and at the end; a rerun in the same
  workdir resumes from the latest one bit-exactly (batches and SR keys are functions of the
  step, metrics written after the checkpoint are dropped and recomputed), but only with the
  same config: a workdir holding a run with another config is refused (naming the keys that
  differ) unless ``allow_changes`` (``--allow-changes train.steps``) names them, and then
  ``config_changes.jsonl`` and ``result.json`` record what changed at which step;
* Ctrl-C stops after the step in progress, saves a checkpoint and says how to resume
  (:class:`TrainingInterrupted`; a second Ctrl-C aborts at once);
* ``metrics.jsonl`` (one line per step, plus ``val`` and ``probe`` lines) and TensorBoard
  event files under ``tb/``; a progress bar with loss and tokens/s;
* a non-finite loss or gradient: the step is rejected on the device, the last good state is
  saved and :class:`TrainingDiverged` names the step;
* ``train.bf16_last_fraction``: the last fraction of the steps run with every layer in BF16
  (the NVFP4 paper's late precision switch);
* numerics probes every ``probes.every`` steps: for every quantized layer and each of the six
  GEMM operands (fprop X/W, dgrad dY/W, wgrad X/dY, the gradients being that step's real
  ones) underflow, saturation, relative MSE, SQNR and scale health (``fp4lab.qdot`` probes).
  ``probes.fused=True`` computes them in the training step itself (one compiled program, about
  10 % slower per step on CPU), ``False`` compiles a separate probing step used only on probe
  steps (better for long runs).

    python -m experiments.train --config experiments/configs/default.py train.steps=300 \
        precision.policy=nemotron3 --workdir results/runs/nemotron3
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from experiments import policies
from experiments.data import TextData, load_text
from experiments.model import HybridLM, ModelConfig
from fp4lab import delayed
from fp4lab.flax import quantize_model
from fp4lab.metrics import METRIC_NAMES
from fp4lab.qdot import OPERANDS

__all__ = ["train", "TrainingDiverged", "TrainingInterrupted", "TrainState", "layer_kind",
           "layer_order", "write_json_atomic", "read_jsonl"]


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


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    bad_step: jax.Array  # -1, or the first step whose loss/gradient was not finite
    # FP8 delayed scaling: the "amax_history" collection (None when no layer uses it)
    amax_history: dict | None = None


# ----------------------------------------------------------------------------- small helpers


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader sees the old file or the new one, never a partial one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=float) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def layer_kind(path: str) -> str:
    """``blocks_3/mamba/out_proj`` -> ``mamba/out_proj`` (the layer's role, without depth)."""
    return re.sub(r"(?:^|(?<=/))blocks_\d+/", "", path)


KIND_ORDER = ("mamba/in_proj", "mamba/out_proj", "attention/qkv", "attention/out", "mlp/up",
              "mlp/down", "head")


def layer_order(path: str):
    """Sort key: block index (layers outside blocks last), then the role in KIND_ORDER."""
    m = re.match(r"blocks_(\d+)/", path)
    kind = layer_kind(path)
    return (int(m.group(1)) if m else 1 << 30,
            KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER), path)


class Progress:
    """A one-line progress bar on a terminal; plain log lines otherwise."""

    def __init__(self, name: str, total: int, enabled: bool = True):
        self.name, self.total, self.enabled = name, total, enabled
        self.tty = sys.stderr.isatty()

    def update(self, step: int, **values):
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        text = "  ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in values.items())
        if self.tty:
            bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
            sys.stderr.write(f"\r{self.name} [{bar}] {step}/{self.total}  {text}\033[K")
        else:
            sys.stderr.write(f"{self.name} {step}/{self.total}  {text}\n")
        sys.stderr.flush()

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")


# ----------------------------------------------------------------------------- setup


def model_config(config) -> ModelConfig:
    return ModelConfig(**dict(config.model))


def make_optimizer(t) -> tuple[optax.GradientTransformation, optax.Schedule]:
    if t.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup, t.steps,
                                                   end_value=t.lr * t.min_lr_ratio)
    elif t.schedule == "wsd":
        decay = max(1, int(round(t.steps * t.decay_fraction)))
        stable = max(0, t.steps - t.warmup - decay)
        sched = optax.join_schedules([
            optax.linear_schedule(0.0, t.lr, t.warmup), optax.constant_schedule(t.lr),
            optax.linear_schedule(t.lr, t.lr * t.min_lr_ratio, decay)],
            [t.warmup, t.warmup + stable])
    else:
        raise ValueError(f"train.schedule={t.schedule!r}: use 'cosine' or 'wsd'")
    tx = optax.chain(optax.clip_by_global_norm(t.clip),
                     optax.adamw(sched, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
    return tx, sched


def _cross_entropy(logits, targets, weights):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_loss(qmodel, mtp_weight: float):
    def loss_fn(params, probes, history, tokens, weights, key):
        variables = {"params": params}
        if probes is not None:
            variables["probes"] = probes
        if history is not None:
            variables["amax_history"] = history
        logits, mtp_logits = qmodel.apply(variables, tokens[:, :-1], rngs={"quant": key})
        loss = main = _cross_entropy(logits, tokens[:, 1:], weights)
        if mtp_logits is not None:
            loss = loss + mtp_weight * _cross_entropy(mtp_logits[:, :-1], tokens[:, 2:],
                                                      weights[:, 1:])
        return loss, main

    return loss_fn


def make_step(qmodel, tx, sched, seed: int, mtp_weight: float, with_probes: bool):
    loss_fn = make_loss(qmodel, mtp_weight)
    base_key = jax.random.key(seed)

    def step(state: TrainState, tokens, weights, probes):
        key = jax.random.fold_in(base_key, state.step)
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)
        (loss, main), (grads, probe_grads, seen) = grad_fn(
            state.params, probes if with_probes else None, state.amax_history, tokens,
            weights, key)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & (state.bad_step < 0)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
        history = None if state.amax_history is None else keep(
            delayed.update(state.amax_history, seen), state.amax_history)
        new = TrainState(step=jnp.where(ok, state.step + 1, state.step),
                         params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state),
                         bad_step=jnp.where(ok | (state.bad_step >= 0), state.bad_step,
                                            state.step),
                         amax_history=history)
        metrics = {"loss": main, "total_loss": loss, "grad_norm": gnorm,
                   "lr": sched(state.step)}
        return new, metrics, probe_grads

    return jax.jit(step, donate_argnums=0)


def _probe_records(probe_grads) -> dict:
    """``{layer: {operand: {metric: value}}}`` from the probes' gradient (host arrays)."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, prefix + [k])
                continue
            a = np.asarray(v)  # a layer's "gemm", or an intercepted op's (einsum_0, ...)
            name = "/".join(prefix if k == "gemm" else prefix + [k])
            out[name] = {op: {m: float(a[i, j]) for j, m in enumerate(METRIC_NAMES)}
                         for i, op in enumerate(OPERANDS)}

    walk(probe_grads, [])
    return out


def summarize_probes(records: list[dict]) -> dict:
    """Mean over probe steps of each layer/operand/metric (NaN: operand not quantized)."""
    if not records:
        return {}
    layers = records[0]["probes"]
    out = {}
    for layer, ops in layers.items():
        out[layer] = {op: {m: float(np.nanmean([r["probes"][layer][op][m] for r in records]))
                           if any(np.isfinite(r["probes"][layer][op][m]) for r in records)
                           else float("nan") for m in METRIC_NAMES} for op in ops}
    return out


def underflow_by_kind(summary: dict) -> dict[str, float]:
    """Mean underflow over the quantized operands of every layer of each kind."""
    by = {}
    for layer, ops in summary.items():
        vals = [v["underflow"] for v in ops.values() if np.isfinite(v["underflow"])]
        by.setdefault(layer_kind(layer), []).extend(vals)
    return {k: float(np.mean(v)) if v else float("nan") for k, v in sorted(by.items())}


# ----------------------------------------------------------------------------- the run


def _check(config, data: TextData, n_devices: int):
    d, t = config.data, config.train
    if d.batch_size % n_devices:
        raise ValueError(f"data.batch_size={d.batch_size} is not divisible by the "
                         f"{n_devices} local devices (data parallelism splits the batch)")
    need = d.seq_len + 2
    if min(data.train.size, data.val.size) <= need:
        raise ValueError(f"data.seq_len={d.seq_len} does not fit the corpus ({data.train.size} "
                         f"train / {data.val.size} validation tokens)")
    if t.steps < 1 or t.warmup >= t.steps:
        raise ValueError(f"train.steps={t.steps} must be >= 1 and > train.warmup={t.warmup}")
    if not 0 <= t.bf16_last_fraction <= 1:
        raise ValueError(f"train.bf16_last_fraction={t.bf16_last_fraction} is not in [0, 1]")


def _check_resume(stored: Path, config, allow_changes, workdir) -> dict[str, tuple]:
    """The config changes of a resumed run: refused unless every changed key is allowed (by
    its dotted name or its section, e.g. ``train``)."""
    from experiments.configs import config_changes, format_changes

    if not stored.exists():
        return {}
    changes = config_changes(json.loads(stored.read_text()), config.to_dict())
    allowed = set(allow_changes)
    refused = {k: v for k, v in changes.items()
               if k not in allowed and k.split(".")[0] not in allowed}
    if refused:
        raise ValueError(
            f"{workdir} holds a run with another config ({format_changes(refused)}); resuming "
            "it would blend two runs. Use another --workdir, remove this one, or continue "
            f"this run with the new values: --allow-changes {','.join(refused)}")
    return changes


def train(config, workdir, *, data: TextData | None = None, progress: bool = True,
          allow_changes=()) -> dict:
    """Run (or resume) one experiment in ``workdir``; returns the result dict.

    ``allow_changes``: config keys (``"train.steps"``) or sections (``"train"``) that may
    differ from the run already in ``workdir`` when resuming it (see the module docstring)."""
    import orbax.checkpoint as ocp
    from tensorboardX import SummaryWriter

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if config.get("compile_cache"):
        jax.config.update("jax_compilation_cache_dir", str(Path(config.compile_cache).resolve()))
    t, d = config.train, config.data
    policy = policies.get(config.precision.policy)
    model = HybridLM(model_config(config))
    if data is None:
        data = load_text(list(d.paths) or None, val_fraction=d.val_fraction,
                         suffixes=tuple(d.get("suffixes", ())))
    devices = jax.devices()
    _check(config, data, len(devices))
    mesh = Mesh(np.array(devices), ("data",))
    batch_sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def to_global(batch_np):
        """The global batch (every process computes the same one: a function of the step)
        as an array sharded over all devices; each process supplies its devices' rows."""
        if jax.process_count() == 1:
            return jax.device_put(batch_np, batch_sharding)
        return jax.make_array_from_callback(batch_np.shape, batch_sharding,
                                            lambda index: batch_np[index])

    tx, sched = make_optimizer(t)
    sample = jnp.zeros((d.batch_size, d.seq_len), jnp.int32)
    params = model.init(jax.random.key(config.seed), sample)["params"]
    qmodel = quantize_model(model, policy, backend=config.precision.get("backend", "auto"))
    history = qmodel.history_init({"params": params}, sample) or None  # FP8 delayed scaling
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       bad_step=jnp.int32(-1), amax_history=history)
    state = jax.device_put(state, replicated)

    bf16_model = quantize_model(model, policies.get("bf16"))
    probes = qmodel.probe_zeros({"params": params}, sample) if config.probes.every else None
    steps_fn = {}

    def step_fn(model_, with_probes):
        nonlocal last_log
        k = (id(model_), with_probes)
        if k not in steps_fn:  # a new program: its compile time is not training time
            last_log = last_log[:2] + (True,)
            steps_fn[k] = make_step(model_, tx, sched, config.seed, t.mtp_weight, with_probes)
        return steps_fn[k]

    switch = t.steps - int(round(t.steps * t.bf16_last_fraction))
    val = data.val_batches(d.val_batches, d.batch_size, d.seq_len)
    eval_fns = {}

    def evaluate(model_, state):
        """Validation loss (delayed scaling: with the history the next step would use)."""
        if id(model_) not in eval_fns:
            loss_fn = make_loss(model_, 0.0)
            eval_fns[id(model_)] = jax.jit(lambda p, h, tok, w: loss_fn(
                p, None, h, tok, w, jax.random.key(config.seed))[1])
        f = eval_fns[id(model_)]
        return float(np.mean([f(state.params, state.amax_history, to_global(b.tokens),
                                to_global(b.weights)) for b in val]))

    # ---- resume
    ckpt = ocp.CheckpointManager(workdir / "ckpt", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True))
    # process 0 writes the run's files; other processes (multi-host) write theirs beside it
    out = workdir if jax.process_index() == 0 else workdir / f"process_{jax.process_index()}"
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    changes_path = out / "config_changes.jsonl"
    if jax.process_index() == 0:  # what an interrupted save may have left behind
        for tmp_dir in (workdir / "ckpt").glob("*orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    start, changes = 0, {}
    if ckpt.latest_step() is not None:
        changes = _check_resume(out / "config.json", config, allow_changes, workdir)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = ckpt.restore(ckpt.latest_step(), args=ocp.args.StandardRestore(abstract))
        start = int(state.step)
        kept = [r for r in read_jsonl(metrics_path) if r["step"] < start]
        tmp = metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, metrics_path)
    else:
        for stale in (metrics_path, changes_path):
            stale.unlink(missing_ok=True)
    write_json_atomic(out / "config.json", config.to_dict())
    if changes:
        with changes_path.open("a") as f:
            f.write(json.dumps({"step": start, "changes": changes}) + "\n")

    tb = SummaryWriter(str(out / "tb"))
    bar = Progress(config.name, t.steps, progress)
    tokens_per_step = d.batch_size * d.seq_len
    pending: list[tuple[int, dict]] = []
    last_log = (start, time.perf_counter(), False)  # (step, time, interval holds a compile)
    started = time.perf_counter()

    def flush(step_now: int):
        """Fetch the pending metrics (the only host sync), write them, check for NaN."""
        nonlocal pending, last_log
        if not pending:
            return
        values = jax.device_get([m for _, m in pending])
        now = time.perf_counter()
        s0, t0, compiled = last_log
        rate = (step_now - s0) * tokens_per_step / (now - t0)
        with metrics_path.open("a") as f:
            for i, ((s, _), v) in enumerate(zip(pending, values)):
                rec = {"step": s, **{k: float(x) for k, x in v.items()}}
                if i == len(pending) - 1 and not compiled:  # the interval's throughput
                    rec["tokens_per_s"] = rate
                f.write(json.dumps(rec) + "\n")
                for k, x in rec.items():
                    if k not in ("step", "tokens_per_s"):
                        tb.add_scalar(f"train/{k}", x, s)
        tb.add_scalar("train/tokens_per_s", rate, step_now)
        bar.update(step_now, loss=float(values[-1]["loss"]), **{"tok/s": round(rate)})
        pending, last_log = [], (step_now, now, False)
        bad = int(state.bad_step)
        if bad >= 0:
            ckpt.save(bad, args=ocp.args.StandardSave(state), force=True)
            ckpt.wait_until_finished()
            tb.close()
            raise TrainingDiverged(
                f"{config.name}: the loss or gradient became non-finite at step {bad}; saved "
                f"the last good state (before step {bad}) in {workdir / 'ckpt'}")

    def mark(step_now: int):
        """Start a new rate interval (the last one held evaluation, probes or a save)."""
        nonlocal last_log
        last_log = (step_now, time.perf_counter(), False)

    probe_records = [r for r in read_jsonl(metrics_path) if "probes" in r]
    with _StopOnInterrupt() as stop:
        try:
            for s in range(start, t.steps):
                model_s = qmodel if s < switch else bf16_model
                do_probe = bool(config.probes.every) and model_s is qmodel and (
                    s % config.probes.every == 0 or s == t.steps - 1)
                fn = step_fn(model_s, with_probes=bool(probes is not None and (
                    config.probes.fused or do_probe) and model_s is qmodel))
                b = data.batch(config.seed, s, d.batch_size, d.seq_len)
                state, metrics, probe_grads = fn(state, to_global(b.tokens), to_global(b.weights),
                                                 probes)
                pending.append((s, metrics))
                if do_probe:
                    flush(s + 1)
                    rec = {"step": s, "probes": _probe_records(jax.device_get(probe_grads))}
                    probe_records.append(rec)
                    for layer, ops in rec["probes"].items():
                        for op, m in ops.items():
                            for metric in ("underflow", "sqnr_db"):  # NaN: not quantized;
                                if np.isfinite(m[metric]):  # inf dB: exact
                                    tb.add_scalar(f"{metric}/{layer}/{op}", m[metric], s)
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    mark(s + 1)  # the probe fetch is not training time
                if (s + 1) % t.log_every == 0 or s + 1 == t.steps:
                    flush(s + 1)
                if t.eval_every and (s + 1) % t.eval_every == 0 and s + 1 < t.steps:
                    flush(s + 1)
                    v = evaluate(model_s, state)
                    with metrics_path.open("a") as f:
                        f.write(json.dumps({"step": s, "val_loss": v}) + "\n")
                    tb.add_scalar("val/loss", v, s + 1)
                    mark(s + 1)
                if t.ckpt_every and (s + 1) % t.ckpt_every == 0 and s + 1 < t.steps:
                    flush(s + 1)
                    ckpt.save(s + 1, args=ocp.args.StandardSave(state))
                    mark(s + 1)
                if stop.requested and s + 1 < t.steps:
                    flush(s + 1)
                    if ckpt.latest_step() != s + 1:
                        ckpt.save(s + 1, args=ocp.args.StandardSave(state), force=True)
                    ckpt.wait_until_finished()
                    raise TrainingInterrupted(
                        f"{config.name}: interrupted after step {s + 1} of {t.steps}; its "
                        f"checkpoint is in {workdir / 'ckpt'}. Run the same command again to "
                        "resume (bit-exactly).")
            flush(t.steps)
            final_model = qmodel if t.steps - 1 < switch else bf16_model
            val_loss = evaluate(final_model, state)
            with metrics_path.open("a") as f:
                f.write(json.dumps({"step": t.steps - 1, "val_loss": val_loss}) + "\n")
            tb.add_scalar("val/loss", val_loss, t.steps)
            if ckpt.latest_step() != t.steps:  # (a rerun of a finished run restores this one)
                ckpt.save(t.steps, args=ocp.args.StandardSave(state), force=True)
            ckpt.wait_until_finished()
        finally:
            bar.close()
            tb.close()

    steps = [r for r in read_jsonl(metrics_path) if "loss" in r]
    rates = [r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    tail = max(1, len(steps) // 10)
    summary = summarize_probes(probe_records)
    result = {
        "name": config.name, "policy": config.precision.policy, "status": "ok",
        "steps": t.steps, "tokens": t.steps * tokens_per_step,
        "final_train_loss": float(np.mean([r["loss"] for r in steps[-tail:]])),
        "val_loss": val_loss,
        "tokens_per_s": float(np.median(rates)) if rates else float("nan"),
        "probes_fused": bool(config.probes.fused and config.probes.every),
        "wall_s": time.perf_counter() - started, "devices": len(devices),
        "platform": devices[0].platform,
        "underflow_by_kind": underflow_by_kind(summary),
        "probe_summary": summary,
        "layers": {a.path: a.recipe.name if a.recipe else "-"
                   for a in qmodel.explain({"params": params}, sample)},
        "config_changes": read_jsonl(changes_path),
    }
    write_json_atomic(out / "result.json", result)
    return result


def main(argv=None) -> int:
    import argparse

    from experiments.configs import describe_keys, load_config

    default = str(Path(__file__).parent / "configs" / "default.py")
    ap = argparse.ArgumentParser(
        description="Train the hybrid LM under a precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override with key=value) and their defaults in "
               f"configs/default.py:\n{describe_keys(load_config(default))}")
    ap.add_argument("--config", default=default)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--distributed", action="store_true", help="call "
                    "jax.distributed.initialize() first (one process per host)")
    ap.add_argument("--allow-changes", default="", metavar="KEYS",
                    help="comma-separated config keys or sections (train.steps, train) that "
                         "may differ from the run in --workdir: continue it with the new "
                         "values (recorded in config_changes.jsonl)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=300")
    args = ap.parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    config = load_config(args.config, args.overrides)
    allow = tuple(k for k in args.allow_changes.split(",") if k)
    try:
        r = train(config, args.workdir, allow_changes=allow)
    except TrainingInterrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    print(json.dumps({k: v for k, v in r.items() if k not in ("probe_summary", "layers")},
                     indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
