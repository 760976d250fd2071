"""The residual stream stored in FP8 (Qwen3.8-Next): what E4M3 does to a trained LM's stream,
block by block, and what it costs the validation loss.

    python -m experiments.residual --run results/residual/runs/base/bf16-seed0 [--run ...] \
        [--out results/residual_probes] [--batches 2]

For every run and every storage of the stream between blocks (``e4m3``: the E4M3 grid with
no scale, saturating at 448; ``e4m3_token``: one abs-max scale per token), the run's model
(its own gating, its own policy) is evaluated on the validation batches with the stream
stored that way, and :func:`experiments.model.residual_probes` measures each block's stream
before storage: ``saturation`` (the share beyond 448), ``underflow`` (nonzero values stored as
0), SQNR and abs-max. ``loss_change_%`` is the validation loss against the same parameters
with the stream the run trained with (an FP32 stream for a run that trained without FP8).
Runs trained with an FP8 stream are measured in their own format too, where the
straight-through training could adapt to it.

``residual.json`` (every record) and ``residual.md`` (means over the runs per training
setting and storage, with the 95 % interval over runs of the loss change) are written
atomically to ``--out``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments import policies
from experiments.commands import command
from experiments.model import RESIDUAL_FORMATS, HybridLM, residual_probes
from experiments.records import write_report
from experiments.rollout import token_log_probs
from experiments.runs import analysis_parser, load_run, validation_tokens
from experiments.stats import mean_interval
from experiments.tables import interval_cell, markdown_table, yes_no
from fp4lab.flax import quantize_model

__all__ = ["measure_run", "report", "main"]

STORAGES = tuple(f for f in RESIDUAL_FORMATS if f)


def measure_run(workdir, *, batches: int = 2, storages=STORAGES) -> list[dict]:
    """One record per storage format of the run in ``workdir``."""
    from experiments.step import model_config

    run = load_run(workdir)
    config = run.config
    cfg = model_config(config, run.data)
    tokens, targets = validation_tokens(config, run.data, batches)
    rngs = {"quant": jax.random.key(config.seed)}
    variables = {"params": run.params}

    def model(fmt):
        return quantize_model(HybridLM(dataclasses.replace(cfg, residual_format=fmt)),
                              policies.without_outcontrol(policies.get(
                                  config.precision.policy), "experiments.residual"))

    def loss(fmt):
        logits = jax.jit(lambda v, t: model(fmt).apply(v, t, rngs=rngs)[0])(variables, tokens)
        return -float(jnp.mean(token_log_probs(logits, targets)))

    trained, reference = cfg.residual_format, loss(cfg.residual_format)
    out = []
    for fmt in storages:
        blocks = residual_probes(model(fmt), variables, tokens, rngs=rngs)
        value = loss(fmt)
        out.append({"run": str(workdir), "seed": config.seed, "gated": cfg.residual_gate,
                    "trained": trained or "fp32", "storage": fmt, "loss": value,
                    "reference_loss": reference,
                    "loss_change_%": 100 * (value - reference) / reference,
                    "blocks": blocks})
    return out


def report(records: list[dict]) -> str:
    keys = list(dict.fromkeys((r["gated"], r["trained"], r["storage"]) for r in records))
    head = ["gated", "trained with", "stored as", "runs", "val loss change %", "95% CI",
            "max saturation %", "mean underflow %", "min SQNR dB", "max |x|"]
    rows = []
    for k in keys:
        rs = [r for r in records if (r["gated"], r["trained"], r["storage"]) == k]
        change = mean_interval(r["loss_change_%"] for r in rs)
        blocks = [b for r in rs for b in r["blocks"].values()]
        rows.append([
            yes_no(bool(k[0])), k[1], k[2], len(rs), f"{change.mean:+.3f}",
            interval_cell(change, "+.3f"),
            f"{100 * max(b['saturation'] for b in blocks):.3f}",
            f"{100 * np.mean([b['underflow'] for b in blocks]):.3f}",
            f"{min(b['sqnr_db'] for b in blocks):.1f}",
            f"{max(b['amax'] for b in blocks):.1f}"])
    return markdown_table(head, rows)


@command
def main(argv=None) -> int:
    args = analysis_parser("The residual stream stored in FP8: per-block saturation, "
                           "underflow and SQNR, and the loss change.",
                           out="results/residual_probes", batches=2).parse_args(argv)
    records = [r for run in args.run for r in measure_run(run, batches=args.batches)]
    write_report(args.out, "residual", records, report(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
