"""Benchmark: MaxText's own training step on CPU, fp4lab policies vs MaxText unquantized and
MaxText's qwix quantization.

Each variant is one run of MaxText's trainer (``maxtext.trainers.pre_train.train``) in a fresh
process: ``maxtext`` is MaxText unquantized (the baseline), ``fp4lab:<policy>`` runs it through
``python -m fp4lab.integrations.maxtext ... fp4lab.policy=<policy>``, ``qwix:<mode>`` is MaxText's
own ``quantization=<mode> use_qwix_quantization=True`` (qwix fake quantization of its NNX model's
decoder layers). The step time is MaxText's ``perf/step_time_seconds`` (wall time between
consecutive steps, read from its ``metrics_file``), the first ``--warmup`` steps of every run
dropped (compilation, warm-up).

For a shared, noisy machine the runs are interleaved: ``--rounds`` rounds, each running every
variant once in a freshly shuffled order. Per variant: min/median/max over all kept steps, and
the ratio to the baseline paired per round (the median of the variant's steps in a round over
the median of the baseline's steps in that round), as min/median/max over rounds. A variant
whose run fails is reported with the command and the tail of its log, and left out of later
rounds (the exit status is then 1); a failing baseline stops the benchmark.

Run it with MaxText's Python (``sh scripts/maxtext-venv`` builds one):

    .venv-maxtext/bin/python benchmarks/maxtext_step.py [--rounds 3] [--steps 12] \\
        [--variants maxtext,fp4lab:all:nvfp4,qwix:fp8] [--out maxtext_step.json]

``--experts 4`` benchmarks MaxText's MoE (mixtral blocks, ``--experts-per-tok`` experts per
token, each as wide as ``--mlp``) through its ``jax.lax.ragged_dot`` path, ``--moe-dense``
through its einsums.

``--profile`` runs each variant once under MaxText's profiler instead and prints where its
step's time goes (GEMMs, each operand's quantizer, collectives, the rest; see
``benchmarks/profile_step.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "maxtext"
DEFAULT = ("maxtext,fp4lab:all:nvfp4,fp4lab:all:mxfp8,fp4lab:all:bf16,qwix:fp8,qwix:int8")
TRAINER = "maxtext.trainers.pre_train.train"
STEP_TIME = "perf/step_time_seconds"


class RunFailed(RuntimeError):
    """A trainer run that exited non-zero or wrote too few steps; the message names the
    command and shows the tail of its log."""


def model_args(args) -> list[str]:
    """MaxText's ``key=value`` overrides for the benchmarked model, data and mesh."""
    return [
        "hardware=cpu", "skip_jax_distributed_system=True", "dataset_type=synthetic",
        "enable_checkpointing=False", f"steps={args.steps}",
        f"base_emb_dim={args.emb}", f"base_mlp_dim={args.mlp}",
        f"base_num_decoder_layers={args.layers}", f"base_num_query_heads={args.heads}",
        f"base_num_kv_heads={args.heads}", f"head_dim={args.head_dim}",
        f"vocab_size={args.vocab}", f"max_target_length={args.seq}",
        f"per_device_batch_size={args.batch}", f"ici_fsdp_parallelism={args.fsdp}",
        f"ici_tensor_parallelism={args.tensor}",
    ] + ([  # MaxText's MoE (mixtral blocks): its ragged_dot path, or its einsums (--moe-dense)
        "decoder_block=mixtral", f"num_experts={args.experts}",
        f"num_experts_per_tok={args.experts_per_tok}", f"base_moe_mlp_dim={args.mlp}",
        "megablox=False", f"sparse_matmul={not args.moe_dense}",
    ] if args.experts else [])


def variant_argv(variant: str, base_yml: str) -> list[str]:
    """``-m <module> <config> [variant keys]`` for one variant name (see the module doc)."""
    kind, _, value = variant.partition(":")
    if kind == BASELINE and not value:
        return ["-m", TRAINER, base_yml]
    if kind == "fp4lab" and value:
        return ["-m", "fp4lab.integrations.maxtext", "base.yml", f"fp4lab.policy={value}"]
    if kind == "qwix" and value:
        return ["-m", TRAINER, base_yml, f"quantization={value}", "use_qwix_quantization=True"]
    raise ValueError(f"variant {variant!r}: give {BASELINE}, fp4lab:<policy> or qwix:<mode>")


def base_yml_of(python: str) -> str:
    """The path of MaxText's ``configs/base.yml`` in ``python``'s environment."""
    code = ("import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "
            "'configs', 'base.yml'))")
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"{python} cannot import maxtext (run this with MaxText's Python, "
                         f"or give --python):\n{found.stderr[-2000:]}")
    return found.stdout.strip()


def child_env(devices: int, xla_flags: str = "") -> dict:
    return {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {xla_flags}"}


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def run_once(cmd: list[str], name: str, logs: Path, devices: int, timeout: float,
             xla_flags: str = "") -> list[dict]:
    """Runs one trainer command, its stdout and stderr to ``logs/<name>.{out,err}`` (files,
    not pipes), and returns its metrics, one dict per step. Raises :class:`RunFailed`."""
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    with out.open("w") as o, err.open("w") as e:
        try:
            code = subprocess.run(cmd, stdout=o, stderr=e, cwd=logs,
                                  env=child_env(devices, xla_flags), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout after {timeout:.0f} s"
    metrics = logs / f"{name}.jsonl"
    if code != 0 or not metrics.exists():
        raise RunFailed(f"{' '.join(cmd)}\nfailed ({code}); the tail of {err}:\n{tail(err)}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def kept_steps(metrics: list[dict], warmup: int, steps: int, cmd: list[str]) -> list[float]:
    """The step times after the first ``warmup`` steps; all ``steps`` must be there."""
    if len(metrics) != steps:
        raise RunFailed(f"{' '.join(cmd)}\nwrote {len(metrics)} steps of metrics, not {steps}")
    return [m[STEP_TIME] for m in metrics[warmup:]]


def schedule(variants: list[str], rounds: int, seed: int) -> list[list[str]]:
    """Every variant once per round, each round in its own seeded random order."""
    rng = random.Random(seed)
    return [rng.sample(variants, len(variants)) for _ in range(rounds)]


def variant_cmd(args, variant: str, name: str, base_yml: str, logs: Path) -> list[str]:
    return [args.python, *variant_argv(variant, base_yml), *model_args(args),
            f"base_output_directory={logs}", f"run_name={name}",
            f"metrics_file={logs / name}.jsonl"]


def run_variant(args, variant: str, name: str, base_yml: str, logs: Path):
    """One run of ``variant``: its kept step times (s) and its last step's loss."""
    cmd = variant_cmd(args, variant, name, base_yml, logs)
    metrics = run_once(cmd, name, logs, args.fsdp * args.tensor, args.timeout)
    return kept_steps(metrics, args.warmup, args.steps, cmd), metrics[-1]["learning/loss"]


def profile_variants(args, base_yml: str, logs: Path) -> str:
    """``--profile``: one run of each variant under MaxText's profiler (``profiler=xplane``,
    the steps after the warm-up but the last) with XLA's optimized programs dumped; the time
    of their ops attributed as ``benchmarks/profile_step.py`` does, one column per variant."""
    import profile_step  # beside this script

    profiled = args.steps - args.warmup - 1
    rows = {}
    for v in args.variants.split(","):
        name = f"profile-{v.replace(':', '_')}"
        hlo = logs / name / "hlo"
        cmd = [*variant_cmd(args, v, name, base_yml, logs), "profiler=xplane",
               f"skip_first_n_steps_for_profiler={args.warmup}", f"profiler_steps={profiled}"]
        run_once(cmd, name, logs, args.fsdp * args.tensor, args.timeout,
                 f"--xla_dump_to={hlo} --xla_dump_hlo_as_text")
        (xplane,) = (logs / name).rglob("*.xplane.pb")
        rows[v] = profile_step.attribute(profile_step.read_events(xplane),
                                         profile_step.dumped_programs(hlo))
        print(f"profiled {v}", flush=True)
    return profile_step.table(rows, dict.fromkeys(rows, profiled))


def run_rounds(args, base_yml: str, logs: Path) -> dict:
    """Runs the schedule; returns ``{variant: {"rounds": [[step s, ...] per round],
    "loss": [last loss per round], "error": str | None}}``. A variant that fails is left
    out of later rounds; the baseline failing ends the benchmark."""
    variants = args.variants.split(",")
    results = {v: {"rounds": [], "loss": [], "error": None} for v in variants}
    for r, order in enumerate(schedule(variants, args.rounds, args.seed)):
        for v in (v for v in order if not results[v]["error"]):
            t0, step = time.perf_counter(), float("nan")
            try:
                steps, loss = run_variant(args, v, f"r{r}-{v.replace(':', '_')}", base_yml,
                                          logs)
                results[v]["rounds"].append(steps)
                results[v]["loss"].append(loss)
                step = statistics.median(steps)
            except RunFailed as failed:
                if v == BASELINE:
                    raise SystemExit(f"the baseline failed: {failed}") from None
                results[v]["error"] = str(failed)
                print(f"{v} failed, left out of later rounds: {failed}", file=sys.stderr)
            print(f"round {r + 1}/{args.rounds} {v:24s} {time.perf_counter() - t0:6.1f} s "
                  f"median step {step * 1e3:8.1f} ms", flush=True)
    return results


def summarize(results: dict) -> list[dict]:
    """One row per variant: step-time min/median/max over all kept steps (s) and the
    per-round paired ratio to the baseline, min/median/max over the rounds both finished."""
    base = [statistics.median(steps) for steps in results[BASELINE]["rounds"]]
    rows = []
    for v, res in results.items():
        row = {"variant": v, "error": res["error"], "rounds": len(res["rounds"])}
        steps = [t for r in res["rounds"] for t in r]
        if steps and not res["error"]:
            ratios = [statistics.median(r) / b for r, b in zip(res["rounds"], base, strict=True)]
            row.update(min=min(steps), median=statistics.median(steps), max=max(steps),
                       ratio_min=min(ratios), ratio_median=statistics.median(ratios),
                       ratio_max=max(ratios), loss=statistics.median(res["loss"]))
        rows.append(row)
    return rows


def reason(error: str | None) -> str:
    """The line of a failed run's log that says why, in short: its last error line."""
    lines = [line.strip() for line in (error or "no steps").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors or lines)[-1][:160].replace("|", "/")


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (times in ms; a failed variant says why, in short)."""
    lines = ["| variant | ms/step min | median | max | vs maxtext (median of rounds) "
             "| [min, max] | last loss |", "|---|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        if "median" not in row:
            lines.append(f"| {row['variant']} | failed: {reason(row['error'])} | | | | | |")
            continue
        lines.append(f"| {row['variant']} | {row['min'] * 1e3:.1f} | {row['median'] * 1e3:.1f}"
                     f" | {row['max'] * 1e3:.1f} | {row['ratio_median']:.2f}x | "
                     f"[{row['ratio_min']:.2f}, {row['ratio_max']:.2f}] | {row['loss']:.3f} |")
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    """Writes ``data`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", default=DEFAULT,
                    help=f"comma list of {BASELINE}, fp4lab:<policy>, qwix:<mode>")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run dropped")
    ap.add_argument("--emb", type=int, default=256, help="base_emb_dim")
    ap.add_argument("--mlp", type=int, default=1024, help="base_mlp_dim")
    ap.add_argument("--layers", type=int, default=4, help="base_num_decoder_layers")
    ap.add_argument("--heads", type=int, default=4, help="query and kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256, help="vocab_size")
    ap.add_argument("--seq", type=int, default=256, help="max_target_length")
    ap.add_argument("--batch", type=int, default=1, help="per_device_batch_size")
    ap.add_argument("--fsdp", type=int, default=2, help="ici_fsdp_parallelism")
    ap.add_argument("--tensor", type=int, default=2, help="ici_tensor_parallelism")
    ap.add_argument("--experts", type=int, default=0,
                    help="MoE experts per layer (0: MaxText's dense MLP)")
    ap.add_argument("--experts-per-tok", type=int, default=2, help="num_experts_per_tok")
    ap.add_argument("--moe-dense", action="store_true",
                    help="MaxText's dense MoE path (its experts as einsums)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round orders")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--python", default=sys.executable, help="MaxText's Python")
    ap.add_argument("--logs", type=Path, help="keep the runs' logs here (default: a "
                    "temporary folder, removed when every run succeeded)")
    ap.add_argument("--out", type=Path, default=Path("maxtext_step.json"),
                    help="JSON of the raw per-step times and the table")
    ap.add_argument("--profile", action="store_true", help="instead of timing rounds, "
                    "profile one run of each variant: where its step's time goes")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + args.profile:  # a profile ends a step before the last
        ap.error(f"--steps {args.steps} leaves no step to time after --warmup {args.warmup}")
    if BASELINE not in args.variants.split(","):
        ap.error(f"--variants {args.variants!r} must include the baseline {BASELINE!r}")
    for v in args.variants.split(","):
        variant_argv(v, "base.yml")  # a bad name fails now
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    base_yml = base_yml_of(args.python)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="maxtext_step."))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"MaxText {args.layers} layers, d {args.emb}, mlp {args.mlp}, {args.heads} heads x "
          f"{args.head_dim}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}/device, "
          f"fsdp {args.fsdp} x tensor {args.tensor} CPU devices; {args.rounds} rounds of "
          f"{args.steps} steps, first {args.warmup} dropped; logs in {logs}", flush=True)
    if args.profile:
        table = profile_variants(args, base_yml, logs)
        print(table)
        if args.logs is None:
            shutil.rmtree(logs, ignore_errors=True)
        return {"rows": [], "table": table}
    results = run_rounds(args, base_yml, logs)
    rows = summarize(results)
    table = markdown(rows)
    print(table)
    write_json(args.out, {"config": {k: str(v) for k, v in vars(args).items()},
                          "steps_s": {v: r["rounds"] for v, r in results.items()},
                          "loss": {v: r["loss"] for v, r in results.items()},
                          "rows": rows, "table": table})
    if args.logs is None and not any(r["error"] for r in results.values()):
        shutil.rmtree(logs, ignore_errors=True)
    return {"rows": rows, "table": table}


if __name__ == "__main__":
    rows = main()["rows"]
    sys.exit(1 if any(row["error"] for row in rows) else 0)  # after the table and the JSON
