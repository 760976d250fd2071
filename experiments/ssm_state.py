"""SSM state precision: a trained LM decoded with its Mamba-2 state stored in lower precision,
against the same model with an FP32 state (the analogue of Nemotron 3 Ultra's Table 16).

    python -m experiments.ssm_state --run results/sweep/runs/bf16-seed0 [--run ...] \
        [--out results/ssm_state] [--batches 2] [--sample 48]

Every Mamba-2 block runs its recurrence one step at a time (``model.ssm_state_format``,
``experiments.model``), storing the state after each step in a format: ``fp32`` (the
reference: it equals the parallel scan up to float32 reassociation, measured here), ``bf16``,
``fp16``, ``int8_block128``, ``fp8_block128`` (blocks of 128 along each head's flattened
state), each with round-to-nearest or stochastic rounding (a key per run, folded per layer
by Flax and per step). Per run and format it measures, on the validation batches:

* ``kl``: the per-token KL(p_fp32 || p_format) of the next-token distributions, as a function
  of the position (mean per quarter of the sequence) and overall;
* ``loss_change_%``: the relative change of the validation loss;
* with ``--sample N``: from the first ``seq_len - N`` tokens, both models sample ``N``
  tokens with the same keys; ``line_length`` is the mean number of tokens before the first
  newline (capped at ``N``), a verbosity proxy on this byte-level code corpus, and
  ``length_change_%`` its relative change against the FP32 state.

``ssm_state.json`` (every record) and ``ssm_state.md`` (means over the runs, the 95 %
interval over runs of the overall KL) are written atomically to ``--out``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.commands import command
from experiments.model import HybridLM
from experiments.records import write_report
from experiments.rollout import sample_tokens, token_log_probs
from experiments.runs import analysis_parser, load_run, validation_tokens
from experiments.stats import mean_interval
from experiments.tables import interval_cell, markdown_table
from fp4lab.flax import quantize_model

__all__ = ["VARIANTS", "measure_run", "main"]

VARIANTS = tuple((f, r) for f in ("bf16", "fp16", "int8_block128", "fp8_block128")
                 for r in ("nearest", "stochastic"))
NEWLINE = 10  # the byte


def _model(cfg, fmt: str, rounding: str, key):
    """``f(params, tokens) -> float32 logits`` with the state in ``fmt`` (BF16 GEMMs)."""
    model = quantize_model(HybridLM(dataclasses.replace(
        cfg, ssm_state_format=fmt, ssm_state_rounding=rounding)), "all:bf16")

    def f(params, tokens):
        return model.apply({"params": params}, tokens,
                           rngs={"quant": key, "ssm_state": key})[0].astype(jnp.float32)

    return jax.jit(f)


def _line_length(tokens_BxN) -> np.ndarray:
    nl = np.asarray(tokens_BxN) == NEWLINE
    return np.where(nl.any(1), nl.argmax(1), nl.shape[1]).astype(float)


def measure_run(workdir, *, batches: int = 2, sample: int = 0, variants=VARIANTS) -> list[dict]:
    """One record per state format and rounding of the run in ``workdir``."""
    from experiments.step import model_config

    run = load_run(workdir)
    config, params, data = run.config, run.params, run.data
    d = config.data
    if sample and not 0 < sample < d.seq_len:
        raise ValueError(f"--sample {sample} must be in (0, data.seq_len={d.seq_len})")
    cfg = model_config(config, data)
    if "M" not in cfg.pattern:
        raise ValueError(f"model.pattern={cfg.pattern!r} has no Mamba block")
    tokens, targets = validation_tokens(config, data, batches)
    key = jax.random.key(config.seed)
    ref_fn = _model(cfg, "fp32", "nearest", key)
    ref_logits = ref_fn(params, tokens)
    parallel = _model(cfg, "", "nearest", key)(params, tokens)
    ref_logp = jax.nn.log_softmax(ref_logits, axis=-1)
    ref_loss = -float(jnp.mean(token_log_probs(ref_logits, targets)))
    ref_len = None
    if sample:
        ref_toks, _ = sample_tokens(ref_fn, params, tokens, sample, key)
        ref_len = _line_length(ref_toks[:, -sample:])
    out = []
    quarters = np.array_split(np.arange(tokens.shape[1]), 4)
    for fmt, rounding in variants:
        fn = _model(cfg, fmt, rounding, key)
        logits = fn(params, tokens)
        logp = jax.nn.log_softmax(logits, axis=-1)
        kl_BxL = np.asarray(jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1))
        loss = -float(jnp.mean(token_log_probs(logits, targets)))
        rec = {"run": str(workdir), "seed": config.seed, "format": fmt, "rounding": rounding,
               "kl": float(kl_BxL.mean()),
               "kl_by_quarter": [float(kl_BxL[:, q].mean()) for q in quarters],
               "loss": loss, "loss_change_%": 100 * (loss - ref_loss) / ref_loss,
               "reference_loss": ref_loss,
               "fp32_recurrent_vs_parallel_max_abs_logit": float(
                   jnp.max(jnp.abs(ref_logits - parallel)))}
        if sample:
            toks, _ = sample_tokens(fn, params, tokens, sample, key)
            length = _line_length(toks[:, -sample:])
            rec.update(line_length=float(length.mean()), reference_line_length=float(
                ref_len.mean()), **{"length_change_%": float(
                    100 * (length.mean() - ref_len.mean()) / max(ref_len.mean(), 1e-9))})
        out.append(rec)
    return out


def report(records: list[dict]) -> str:
    keys = list(dict.fromkeys((r["format"], r["rounding"]) for r in records))
    has_len = any("line_length" in r for r in records)
    head = ["state", "rounding", "runs", "KL (nats/token)", "95% CI", "KL by quarter",
            "val loss change %"] + (["line length change %"] if has_len else [])
    rows = []
    for k in keys:
        rs = [r for r in records if (r["format"], r["rounding"]) == k]
        kl = mean_interval(r["kl"] for r in rs)
        by_q = np.mean([r["kl_by_quarter"] for r in rs], axis=0)
        row = [k[0], k[1], len(rs), f"{kl.mean:.2e}", interval_cell(kl, ".2e"),
               " / ".join(f"{v:.1e}" for v in by_q),
               f"{np.mean([r['loss_change_%'] for r in rs]):+.3f}"]
        if has_len:
            row.append(f"{np.mean([r['length_change_%'] for r in rs]):+.1f}")
        rows.append(row)
    return markdown_table(head, rows)


@command
def main(argv=None) -> int:
    ap = analysis_parser("SSM state precision of a trained LM: KL to the FP32 state per "
                         "position, loss and length changes.", out="results/ssm_state",
                         batches=2)
    ap.add_argument("--sample", type=int, default=48, help="tokens sampled per row (0: off)")
    args = ap.parse_args(argv)
    records = [r for run in args.run for r in measure_run(run, batches=args.batches,
                                                          sample=args.sample)]
    write_report(args.out, "ssm_state", records, report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
