"""Finished training runs read back, for the analyses of trained runs (``experiments.rollout``,
``ssm_state``, ``residual``, ``export``): one loader, one source of validation tokens and the
command line they share.

:func:`load_run` reads a run's folder (``experiments.train`` wrote it): its ``config.json``,
its data and the parameters of its latest checkpoint, and nothing else: no optimizer state,
no quantized or BF16 twin model, no probes. A run whose policy no longer says what it trained
under (an edited ``file:`` policy, a named policy changed in the code) is refused, as
resuming it would be (``experiments.run_spec.resolve_policy``).

A run's own files are read through :mod:`experiments.run_files` (a damaged one: one line).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.configs import with_defaults
from experiments.data import TextData, load_data
from experiments.run_files import read_run_json

__all__ = ["Run", "load_run", "validation_tokens", "analysis_parser"]


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run: its folder (absolute), its config as stored (``config.json``: with
    what it resolved to, ``experiments.run_spec.config_record``), the float32 parameters of its
    latest checkpoint and its data (the corpus it trained on, validation split included)."""

    workdir: Path
    config: ml_collections.ConfigDict
    params: dict
    data: TextData


def load_run(workdir) -> Run:
    """The run in ``workdir``. FileNotFoundError if it holds no run (no ``config.json``) or
    no checkpoint; ValueError if its policy has changed since it trained, or if its
    ``config.json`` or latest checkpoint is damaged (:func:`read_run_json`,
    :func:`check_checkpoint`)."""
    from experiments.model import HybridLM
    from experiments.step import model_config
    from experiments.checkpoints import restore_params
    from experiments.run_spec import resolve_policy

    workdir = Path(workdir).resolve()
    if not (workdir / "config.json").exists():
        raise FileNotFoundError(f"{str(workdir)!r} holds no run (no config.json)")
    config = ml_collections.ConfigDict(with_defaults(read_run_json(workdir, "config.json")))
    if not (workdir / "ckpt").is_dir():
        raise FileNotFoundError(f"{str(workdir)!r} has no checkpoint to read parameters from")
    resolve_policy(config)
    data = load_data(config.data)
    model = HybridLM(model_config(config, data))
    sample = jnp.zeros((config.data.batch_size, config.data.seq_len), jnp.int32)
    like = jax.eval_shape(lambda: model.init(jax.random.key(config.seed), sample)["params"])
    return Run(workdir, config, restore_params(workdir, like), data)


# ----------------------------------------------------------------------------- damage

# what to do about a damaged file of a run (read_run_json), by its name
def validation_tokens(config, data: TextData, batches: int) -> tuple[jax.Array, jax.Array]:
    """``batches`` validation batches of the run's data (``TextData.val_batches``: windows of
    ``data.seq_len + 1`` tokens evenly spaced through the validation split, ``data.batch_size``
    per batch) as ``(inputs, targets)``: int32 ``[batches * batch_size, seq_len]`` arrays,
    the targets being the inputs shifted by one token."""
    d = config.data
    tokens = np.concatenate([b.tokens for b in data.val_batches(batches, d.batch_size,
                                                                d.seq_len)])
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def analysis_parser(description: str, *, out: str, batches: int) -> argparse.ArgumentParser:
    """The command line every analysis of trained runs shares: ``--run`` (repeated, one per
    seed), ``--out`` and ``--batches`` (validation batches measured)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--run", action="append", required=True, help="a finished run's folder "
                    "(repeat for several seeds)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--batches", type=int, default=batches, help="validation batches measured")
    return ap
