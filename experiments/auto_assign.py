"""Recommend a per-layer precision policy from short probe runs.

For each candidate recipe on a ladder from cheapest to most precise (default ``nvfp4``,
``mxfp8``, ``bf16``), a short run trains the model with every layer in that recipe and probes
every GEMM operand (``experiments.train``). Each layer then gets the cheapest candidate whose
quantized operands all stay within the thresholds, averaged over the probe steps:

* ``max_underflow``: the flush-to-zero rate (default 5 %, the rate at which Transformer
  Engine's debug tooling flags a GEMM for high precision);
* ``max_mse``: the absolute mean squared quantization error (default 1e-4, TE's threshold);
* ``max_rel_mse``: optionally, the error relative to the tensor's energy (scale-free);
* ``operands``: which GEMM operands must pass (default all six; e.g. only the forward ones).

The last rung is the fallback (it is not probed) and the policy's default. The result is a
:class:`~fp4lab.policy.PrecisionPolicy` (one rule per recipe, an exact alternation of layer
paths), written as JSON for ``precision.policy=file:<path>`` and printed with ``explain``.

    python -m experiments.auto_assign [--config default] [--steps 30] [--max-underflow 0.05]
        [--max-mse 1e-4] [--ladder nvfp4,mxfp8,bf16] [--out results/auto/policy.json]
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from experiments.commands import command
from experiments.probe_records import layer_order
from experiments.train import train
from fp4lab.policy import PrecisionPolicy, Rule, explain, save_policy
from fp4lab.gemm.recipe import OPERANDS
from fp4lab.gemm.recipe import get_recipe

__all__ = ["layer_passes", "recommend", "assign_from_summaries", "main"]


def layer_passes(ops: dict, max_underflow: float, max_mse: float,
                 max_rel_mse: float | None = None, operands=None) -> tuple[bool, str]:
    """Whether every quantized operand of one layer (of ``operands``, default all six) is
    within the thresholds, and why not."""
    for op, m in ops.items():
        if operands is not None and op not in operands:
            continue
        if not math.isfinite(m["underflow"]):  # not quantized in this GEMM
            continue
        if m["underflow"] > max_underflow:
            return False, f"{op} underflow {m['underflow']:.1%} > {max_underflow:.1%}"
        if m["mse"] > max_mse:
            return False, f"{op} mse {m['mse']:.2e} > {max_mse:.0e}"
        if max_rel_mse is not None and m["rel_mse"] > max_rel_mse:
            return False, f"{op} rel_mse {m['rel_mse']:.2e} > {max_rel_mse:.0e}"
    return True, ""


def assign_from_summaries(summaries: dict[str, dict], ladder, *, max_underflow: float = 0.05,
                          max_mse: float = 1e-4, max_rel_mse: float | None = None,
                          operands=None) -> tuple[PrecisionPolicy, dict[str, tuple[str, str]]]:
    """The policy from per-candidate probe summaries (``{recipe: {layer: {op: metrics}}}``,
    one per rung but the last). Returns it and ``{layer: (recipe, reason)}``."""
    ladder = [get_recipe(r).name for r in ladder]
    if operands is not None:
        unknown = sorted(set(operands) - set(OPERANDS))
        if unknown:
            raise ValueError(f"unknown operands {unknown}; known: {', '.join(OPERANDS)}")
    if len(ladder) < 2:
        raise ValueError(f"ladder {ladder} needs at least one candidate and a fallback")
    missing = [r for r in ladder[:-1] if r not in summaries]
    if missing:
        raise ValueError(f"no probe summary for candidates {missing}")
    layers = sorted(summaries[ladder[0]], key=layer_order)
    if not layers:
        raise ValueError(f"the {ladder[0]} probe run recorded no layers (probes.every=0?)")
    chosen: dict[str, tuple[str, str]] = {}
    for layer in layers:
        reasons = []
        for cand in ladder[:-1]:
            ok, why = layer_passes(summaries[cand][layer], max_underflow, max_mse, max_rel_mse,
                                   operands)
            if ok:
                chosen[layer] = (cand, "; ".join(reasons) or "within thresholds")
                break
            reasons.append(f"{cand}: {why}")
        else:
            chosen[layer] = (ladder[-1], "; ".join(reasons))
    rules = []
    for cand in ladder[:-1]:
        paths = [p for p, (r, _) in chosen.items() if r == cand]
        if paths:
            rules.append(Rule(recipe=cand, name=f"auto: {len(paths)} layers in {cand}",
                              pattern="|".join(re.escape(p) for p in paths)))
    policy = PrecisionPolicy(rules=tuple(rules), default=ladder[-1], name="auto")
    return policy, chosen


def recommend(config, workdir: str | Path, *, ladder=("nvfp4", "mxfp8", "bf16"),
              steps: int = 30, max_underflow: float = 0.05, max_mse: float = 1e-4,
              max_rel_mse: float | None = None, operands=None, progress: bool = True):
    """Probe runs for every candidate but the last, then :func:`assign_from_summaries`."""
    workdir = Path(workdir)
    summaries = {}
    for cand in ladder[:-1]:
        c = config.copy_and_resolve_references()
        name = get_recipe(cand).name
        c.name, c.precision.policy = f"probe_{name}", name
        c.train.steps = steps
        c.train.warmup = min(c.train.warmup, max(steps // 10, 1))
        c.probes.every = max(1, min(c.probes.every, steps // 3))
        summaries[name] = train(c, workdir / f"probe_{name}", progress=progress)["probe_summary"]
    return assign_from_summaries(summaries, ladder, max_underflow=max_underflow,
                                 max_mse=max_mse, max_rel_mse=max_rel_mse, operands=operands)


@command
def main(argv=None) -> int:
    from experiments.configs import keys_help, load_config

    ap = argparse.ArgumentParser(
        description="Recommend a per-layer precision policy from short probe runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help("default"))
    ap.add_argument("--config", default="default")
    ap.add_argument("--workdir", default="results/auto")
    ap.add_argument("--out", default=None, help="policy JSON (default: <workdir>/policy.json)")
    ap.add_argument("--ladder", default="nvfp4,mxfp8,bf16",
                    help="recipes from cheapest to safest (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="probe-run steps (default: 30)")
    ap.add_argument("--max-underflow", type=float, default=0.05,
                    help="largest underflow an operand may have (default: 0.05)")
    ap.add_argument("--max-mse", type=float, default=1e-4,
                    help="largest absolute MSE (default: 1e-4, TE's switch)")
    ap.add_argument("--max-rel-mse", type=float, default=None,
                    help="largest relative MSE (default: not checked)")
    ap.add_argument("--operands", default=None, help="comma list of the GEMM operands that "
                    f"must pass (default: all of {','.join(OPERANDS)})")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: the probe runs need at least 1 step")
    config = load_config(args.config, args.overrides)
    policy, chosen = recommend(config, args.workdir, ladder=args.ladder.split(","),
                               steps=args.steps, max_underflow=args.max_underflow,
                               max_mse=args.max_mse, max_rel_mse=args.max_rel_mse,
                               operands=args.operands.split(",") if args.operands else None,
                               progress=not args.quiet)
    out = Path(args.out or Path(args.workdir) / "policy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_policy(policy, out)
    for layer, (recipe, why) in chosen.items():
        print(f"{layer:28s} {recipe:8s} {why}")
    print(explain(policy, list(chosen)))
    print(f"wrote {out}; train with precision.policy=file:{out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
