"""Rollout precision and the train/inference mismatch: the same trained parameters and tokens
through a BF16 "trainer" forward and "rollout" forwards in other precisions.

    python -m experiments.rollout --run results/sweep/runs/bf16-seed0 [--run ...] \
        [--out results/rollout] [--batches 4] [--sample 32]

For every ``--run`` (a finished training run's folder: its config and latest checkpoint),
the trainer is the run's model with every GEMM in BF16 (the ``bf16`` policy, as the sweep's
BF16 runs train); a rollout model quantizes the GEMMs of one layer group in one precision
(``fp4lab.policy`` rules, the other layers in BF16):

* precisions: ``fp8_blockwise`` (DeepSeek-V3's block W8A8: 1x128 activations, 128x128
  weights, E4M3), ``mxfp8``, ``nvfp4`` (the recipes' forward operands: 16-element activation
  blocks, 16x16 weight tiles), and ``fp16``: the whole model in FP16 (compute dtype and every
  GEMM), as "Defeating the training-inference mismatch via FP16" serves both engines;
* groups: ``all``, ``linear`` (the Mamba and MLP projections), ``attention`` (qkv and out),
  ``head`` (the output projection).

Two modes, each giving :func:`fp4lab.beyond.mismatch.mismatch_metrics` per rollout model:

* ``teacher``: the validation batches' own tokens scored by both models (the rollout
  "sampled" the data);
* ``sampled`` (``--sample N``): from the first ``seq_len - N`` tokens of each batch, the
  rollout model samples ``N`` tokens (temperature 1, the key a function of the run's seed);
  the rollout log-probabilities are those it sampled from, the trainer's are its forward on
  the same tokens, and only the sampled tokens count.

``mismatch.json`` (every metric per run, mode, precision and group) and ``mismatch.md``
(per mode, precision and group: the mean over the runs of ``token_mult_prob_error``, ``kl``,
``k3_kl``, ``chi2_token`` and ``is_ess``, with the 95 % t interval over the runs of the
multiplicative error) are written atomically to ``--out``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.commands import command
from experiments.model import HybridLM
from experiments.records import write_report
from experiments.runs import analysis_parser, load_run, validation_tokens
from experiments.stats import mean_interval
from experiments.tables import interval_cell, markdown_table, number_cell
from fp4lab.flax import quantize_model
from fp4lab.beyond.mismatch import mismatch_metrics
from fp4lab.policy import PrecisionPolicy, Rule

__all__ = ["GROUPS", "PRECISIONS", "rollout_policy", "token_log_probs", "sample_tokens",
           "measure_run", "report", "main"]

PRECISIONS = ("fp8_blockwise", "mxfp8", "nvfp4", "fp16")
GROUPS = {  # layer paths of experiments.model.HybridLM
    "all": r".*",
    "linear": r"(?:.*/)?(?:mamba|mlp)/\w+",
    "attention": r"(?:.*/)?attention/\w+",
    "head": r"(?:mtp_)?head",
}
MODES = ("teacher", "sampled")


def rollout_policy(precision: str, group: str) -> PrecisionPolicy:
    """``precision`` for the layers of ``group``, BF16 for the rest (``fp16``: FP16 GEMMs,
    the model's compute dtype is set by :func:`measure_run`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown rollout precision {precision!r}; known: "
                         f"{', '.join(PRECISIONS)}")
    if group not in GROUPS:
        raise ValueError(f"unknown layer group {group!r}; known: {', '.join(GROUPS)}")
    return PrecisionPolicy(rules=(Rule(name=group, recipe=precision, pattern=GROUPS[group]),),
                           default="bf16", name=f"{precision}:{group}")


def token_log_probs(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _forward(cfg, precision: str, group: str):
    """``f(params, tokens) -> float32 logits`` of the rollout (or, for ``bf16``, the trainer)
    model of ``cfg`` (an ``experiments.model.ModelConfig``), jitted."""
    if precision == "fp16":
        cfg = dataclasses.replace(cfg, dtype="float16")
    policy = "all:bf16" if precision == "bf16" else rollout_policy(precision, group)
    model = quantize_model(HybridLM(cfg), policy)
    key = jax.random.key(0)  # forward quantizers round to nearest: the key is unused

    def f(params, tokens):
        if precision == "fp16":
            params = jax.tree.map(lambda p: p.astype(jnp.float16), params)
        return model.apply({"params": params}, tokens, rngs={"quant": key})[0].astype(
            jnp.float32)

    return jax.jit(f)


@functools.partial(jax.jit, static_argnums=(0, 3))
def sample_tokens(forward, params, tokens, n: int, key):
    """``n`` tokens sampled after the first ``L - n`` of each row (full causal forwards:
    later positions do not influence earlier logits); returns the tokens and the sampled
    tokens' log-probabilities under the sampling model ``[B, n]``."""
    length = tokens.shape[1]
    start = length - n

    def body(i, carry):
        toks, logps = carry
        logits = forward(params, toks)[:, start + i - 1]
        nxt = jax.random.categorical(jax.random.fold_in(key, i), logits)
        logp = token_log_probs(logits, nxt)
        return toks.at[:, start + i].set(nxt), logps.at[:, i].set(logp)

    return jax.lax.fori_loop(0, n, body, (tokens, jnp.zeros((tokens.shape[0], n))))


def measure_run(workdir, *, batches: int = 4, sample: int = 0,
                precisions=PRECISIONS, groups=tuple(GROUPS)) -> list[dict]:
    """Mismatch metrics of one run: a record per mode, precision and group."""
    from experiments.step import model_config

    run = load_run(workdir)
    config, params, data = run.config, run.params, run.data
    d = config.data
    if sample and not 0 < sample < d.seq_len:
        raise ValueError(f"--sample {sample} must be in (0, data.seq_len={d.seq_len})")
    cfg = model_config(config, data)  # the model as the run trained it
    tokens, targets = validation_tokens(config, data, batches)
    trainer = _forward(cfg, "bf16", "all")
    logp_train = token_log_probs(trainer(params, tokens), targets)
    key = jax.random.key(config.seed)
    out = []
    for precision in precisions:
        for group in (("all",) if precision == "fp16" else groups):
            rollout = _forward(cfg, precision, group)
            logp_rollout = token_log_probs(rollout(params, tokens), targets)
            records = [("teacher", mismatch_metrics(logp_train, logp_rollout))]
            if sample:
                toks, logp_gen = sample_tokens(rollout, params, tokens, sample, key)
                # positions L-1-n ... L-2 predict the sampled tokens at L-n ... L-1
                logp_tr = token_log_probs(trainer(params, toks)[:, :-1], toks[:, 1:])[:, -sample:]
                records.append(("sampled", mismatch_metrics(logp_tr, logp_gen)))
            for mode, m in records:
                out.append({"run": str(workdir), "seed": config.seed, "mode": mode,
                            "precision": precision, "group": group,
                            **{k: float(v) for k, v in m.items()}})
    return out


def report(records: list[dict]) -> str:
    """The Markdown summary: per mode, precision and group, the mean over the runs."""
    keys = []
    for r in records:
        k = (r["mode"], r["precision"], r["group"])
        if k not in keys:
            keys.append(k)
    head = ["mode", "rollout", "group", "runs", "token_mult_prob_error", "95% CI", "kl",
            "k3_kl", "chi2_token", "is_ess"]
    rows = []
    for k in keys:
        rs = [r for r in records if (r["mode"], r["precision"], r["group"]) == k]
        err = mean_interval(r["token_mult_prob_error"] for r in rs)
        mean = {m: float(np.mean([r[m] for r in rs])) for m in ("kl", "k3_kl", "chi2_token",
                                                                "is_ess")}
        rows.append([*k, len(rs), number_cell(err.mean, ".4f"), interval_cell(err, ".4f"),
                     f"{mean['kl']:.2e}", f"{mean['k3_kl']:.2e}", f"{mean['chi2_token']:.2e}",
                     number_cell(mean["is_ess"], ".4f")])
    return markdown_table(head, rows)


@command
def main(argv=None) -> int:
    ap = analysis_parser("Train/inference mismatch of rollouts in other precisions than the "
                         "trainer's.", out="results/rollout", batches=4)
    ap.add_argument("--sample", type=int, default=32, help="tokens sampled per row by the "
                    "rollout model (0: teacher-forced only)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--groups", default=",".join(GROUPS))
    args = ap.parse_args(argv)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    groups = tuple(g for g in args.groups.split(",") if g)
    for p in precisions:
        rollout_policy(p, "all")
    for g in groups:
        rollout_policy("mxfp8", g)
    records = [r for run in args.run for r in measure_run(
        run, batches=args.batches, sample=args.sample, precisions=precisions, groups=groups)]
    write_report(args.out, "mismatch", records, report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
