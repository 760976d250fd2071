"""The training loop of one run: steps (with the late precision switch and the modes of the
stateful features: OutControl's phases, probe steps), evaluation, checkpoints at their
interval, logging, Ctrl-C after a whole step and the stop on a non-finite loss."""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from experiments.checkpoints import Checkpoints
from experiments.probe_records import probe_records
from experiments.records import RunRecords
from experiments.run_spec import switch_step
from experiments.setup import Setup
from experiments.step import TrainState, feature_variables, make_eval, make_step

__all__ = ["Loop", "StepLog", "Interval", "StopOnInterrupt", "TrainingDiverged",
           "TrainingInterrupted"]


class TrainingDiverged(RuntimeError):
    """The loss or gradient became non-finite; the last good state was saved."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped after a whole step and saved a checkpoint to resume from."""


class StopOnInterrupt:
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


@dataclasses.dataclass
class Interval:
    """The steps since the last throughput measurement: from ``step`` at ``time``."""

    step: int
    time: float
    compiled: bool = False  # it holds a compile: its rate is not training speed


@dataclasses.dataclass
class StepLog:
    """The step metrics still on the device and the throughput interval they belong to;
    :meth:`flush` fetches them (the loop's only host sync) and writes them."""

    records: RunRecords
    bar: tqdm
    tokens_per_step: int
    interval: Interval
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)

    def add(self, step: int, metrics: dict):
        self.pending.append((step, metrics))

    def mark(self, step_now: int):
        """Start a new rate interval (the last one held evaluation, probes or a save)."""
        self.interval = Interval(step_now, time.perf_counter())

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
        self.pending, self.interval = [], Interval(step_now, now)
        return True


class _Programs:
    """The compiled train steps (per model and the features' modes) and evaluations of one
    run; a new program marks the log's interval (its compile time is not training time)."""

    def __init__(self, config, setup: Setup, log: StepLog):
        self.config, self.setup, self.log = config, setup, log
        self._steps, self._evals = {}, {}
        self._val = setup.spec.data.val_batches(config.data.val_batches, config.data.batch_size,
                                           config.data.seq_len)

    def step(self, model, modes: tuple[str, ...]):
        k = (id(model), modes)
        if k not in self._steps:
            self.log.interval.compiled = True
            self._steps[k] = make_step(model, self.setup.tx, self.setup.sched,
                                       self.config.seed, self.config.train.mtp_weight,
                                       self.setup.features, modes, self.setup.spec.grad_reduce,
                                       self.setup.place.batch.mesh)
        return self._steps[k]

    def evaluate(self, model, state: TrainState, steps_done: int) -> float:
        """Validation loss after ``steps_done`` steps, with the features' collections as
        the next step would use them (delayed scaling's histories, OutControl's split)."""
        if id(model) not in self._evals:
            self._evals[id(model)] = make_eval(model, self.config.seed)
        f = self._evals[id(model)]
        observed, fixed = feature_variables(self.setup.features, state.features,
                                            self.setup.modes(model, steps_done), training=False)
        return float(np.mean([f(state.params, observed | fixed, *self.setup.place.put(b))
                              for b in self._val]))


@dataclasses.dataclass
class Loop:
    """The training loop of one run, from ``state`` (the resumed one) to ``train.steps``: the
    quantized model until the last ``train.bf16_last_fraction`` of the steps, the all-BF16
    twin after (the late precision switch); a checkpoint every ``train.ckpt_every`` steps and
    at the end."""

    config: object
    setup: Setup
    ckpt: Checkpoints
    records: RunRecords
    log: StepLog
    stop: StopOnInterrupt
    state: TrainState
    probe_history: list[dict]  # the probe lines so far (those before a resumed step too)

    def __post_init__(self):
        self.programs = _Programs(self.config, self.setup, self.log)
        t = self.config.train
        self.switch = switch_step(t)

    def model_at(self, step: int):
        return self.setup.qmodel if step < self.switch else self.setup.bf16_model

    def run(self, start: int) -> float:
        """Train the steps from ``start``; returns the final validation loss."""
        for s in range(start, self.config.train.steps):
            self._step(s)
        return self._finish()

    def _step(self, s: int):
        c, model = self.config, self.model_at(s)
        fn = self.programs.step(model, self.setup.modes(model, s))
        b = self.setup.spec.data.batch(c.seed, s, c.data.batch_size, c.data.seq_len)
        self.state, metrics, reports = fn(self.state, *self.setup.place.put(b))
        self.log.add(s, metrics)
        probes = self.setup.feature("probes")
        if probes is not None and probes.reported(s, model is self.setup.qmodel):
            self._flush(s + 1)
            rec = {"step": s, "probes": probe_records(jax.device_get(reports["probes"]))}
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
