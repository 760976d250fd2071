"""fp4lab policies inside MaxText's own trainer (``python -m fp4lab.integrations.maxtext``), run in
MaxText's environment (``scripts/maxtext-venv``) on MaxText's tiny config: 2 decoder layers,
d 64, synthetic data, on a 4-device CPU mesh (fsdp 2 x tensor 2)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from environments import COMPILE_CACHE, MAXTEXT, python_of
from flax import nnx

from fp4lab.flax import assignments
from fp4lab.integrations.maxtext import Options, quantize, split_args

TINY = ("base.yml hardware=cpu skip_jax_distributed_system=True dataset_type=synthetic "
        "base_emb_dim=64 base_num_decoder_layers=2 base_mlp_dim=128 base_num_query_heads=2 "
        "base_num_kv_heads=2 head_dim=32 vocab_size=256 max_target_length=64 "
        "per_device_batch_size=1 ici_fsdp_parallelism=2 ici_tensor_parallelism=2 "
        "enable_checkpointing=False learning_rate_schedule_steps=3").split()
# (the schedule's length fixed: a run of 2 steps then resumed for a 3rd trains as one of 3)
# MaxText's MoE: every layer's MLP four experts, two per token (sparse_matmul: its
# jax.lax.ragged_dot path; megablox's kernels are refused)
MOE = ("decoder_block=mixtral num_experts=4 num_experts_per_tok=2 base_moe_mlp_dim=128 "
       "megablox=False").split()


def test_fp4labs_keys_are_taken_out_of_maxtexts_command_line():
    rest, options = split_args(["base.yml", "steps=3", "fp4lab.policy=nemotron3",
                                "fp4lab.seed=7", "fp4lab.strict=false"])
    assert rest == ["base.yml", "steps=3"]
    assert options == Options(policy="nemotron3", seed=7, strict=False)
    for bad, says in [("fp4lab.policy=nvfp5", "unknown policy 'nvfp5'"),
                      ("fp4lab.seeds=1", "fp4lab's keys are"),
                      ("fp4lab.seed=x", "not an integer"), ("fp4lab.policy", "fp4lab's keys"),
                      ("fp4lab.probes=underflow,snr", "unknown metric 'snr'")]:
        with pytest.raises(ValueError, match=says):
            split_args(["base.yml", bad])


@pytest.fixture(scope="module")
def maxtext_python():
    return python_of(MAXTEXT)


def _env(devices: int, xla: str = "", **extra: str) -> dict:
    return {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {xla}", **extra}


def train(python, out: Path, name: str, *args: str, module="fp4lab.integrations.maxtext", devices=4,
          check=True, dump=False) -> subprocess.CompletedProcess:
    """One run of MaxText's trainer; its metrics in ``out/<name>.jsonl``, and with ``dump``
    XLA's compiled programs in ``out/<name>.hlo`` (XLA dumps a program loaded from the
    cache too). Its programs go to the tests' JAX cache, not MaxText's default
    ``~/jax_cache``: a run that compiles what an earlier one did (a resume) loads it."""
    cmd = [str(python), "-m", module, *TINY, f"base_output_directory={out}",
           f"run_name={name}", f"metrics_file={out / name}.jsonl",
           f"jax_cache_dir={COMPILE_CACHE}", *args]
    if module != "fp4lab.integrations.maxtext":
        cmd[3] = _base_yml(python)
    xla = f"--xla_dump_to={out / name}.hlo --xla_dump_hlo_as_text" if dump else ""
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out,
                         env=_env(devices, xla))
    if check and run.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}\n"
                             f"{run.stderr[-6000:]}")
    return run


def _base_yml(python) -> str:
    return subprocess.run([str(python), "-c", "import maxtext, os; print(os.path.join("
                           "os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def table(stdout: str) -> dict[str, tuple[str, str]]:
    """The assignment table fp4lab.integrations.maxtext prints: layer -> (block, recipe)."""
    rows = [line.split() for line in stdout.splitlines() if line.startswith("decoder/")]
    return {row[0]: (row[2], row[3]) for row in rows}


def step_hlo(out: Path, name: str) -> str:
    """The train step MaxText compiled in run ``name`` (``dump=True``), as HLO text."""
    found = sorted((out / f"{name}.hlo").glob("*jit_train_step*after_optimizations.txt"))
    assert found, f"no train step in {out / name}.hlo"
    return found[-1].read_text()


def step_collectives(out: Path, name: str):
    """The collectives of run ``name``'s train step."""
    from hlo import collectives

    return collectives(step_hlo(out, name))


def step_moved(out: Path, name: str):
    """The elements the collectives of run ``name``'s train step move, by kind."""
    from hlo import moved_elements

    return moved_elements(step_hlo(out, name))


def losses(out: Path, name: str) -> list[float]:
    lines = (out / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["learning/loss"] for line in lines if line.strip()]


@pytest.mark.slow
def test_all_bf16_is_maxtexts_model_nvfp4_trains_resumes_and_runs_on_two_processes(
        maxtext_python, tmp_path):
    """On MaxText's MoE model (its experts through ``jax.lax.ragged_dot``, computed under
    ``shard_map``), fp4lab's all:bf16 gives MaxText's own losses bit for bit;
    NVFP4 on every GEMM trains, its losses within a few percent of them. Its compiled step on
    the fsdp x tensor mesh moves the same tensor all-reduces as MaxText's, adds one-element
    all-reduces (the per-tensor amaxes) and at most one all-gather per GEMM (an operand the
    GEMM gathers, FSDP's weights, gathered once per quantized copy: docs/sharding.md).

    MaxText's checkpoints hold fp4lab's SR streams (a counter per stacked block, which
    advances each step although MaxText's scan writes back no RNG state), and a run resumed
    from one continues as the uninterrupted run does, bit for bit, also when the resumed part
    reports its probes in MaxText's metrics (each block of each GEMM, each quantized operand):
    probes change no loss. Two JAX processes of two CPU devices each (gloo collectives),
    initialized by MaxText itself, train the first NVFP4 step with the one-process loss.
    (One test: its runs are each other's references, ~30 s a MaxText start.)"""
    train(maxtext_python, tmp_path, "maxtext", "steps=3", *MOE,
          module="maxtext.trainers.pre_train.train", dump=True)
    train(maxtext_python, tmp_path, "bf16", "steps=3", *MOE, "fp4lab.policy=all:bf16")
    base = losses(tmp_path, "maxtext")
    assert losses(tmp_path, "bf16") == base and len(base) == 3
    nvfp4 = (*MOE, "fp4lab.policy=all:nvfp4", "fp4lab.seed=3")
    run = train(maxtext_python, tmp_path, "nvfp4", "steps=3", *nvfp4, dump=True)
    gemms = table(run.stdout)
    assert gemms["decoder/layers/MoeBlock_0/ragged_dot_2"] == ("0-1", "nvfp4")
    assert len(gemms) == 8  # attention's 4, the 3 expert stacks, the logits
    whole = losses(tmp_path, "nvfp4")
    assert whole != base and np.all(np.isfinite(whole))
    np.testing.assert_allclose(whole, base, rtol=0.03)
    from hlo import moving, scalar

    before, after = (step_collectives(tmp_path, n) for n in ("maxtext", "nvfp4"))
    assert moving(before)["all-reduce"] >= 1 and moving(before)["all-gather"] >= 1
    added = moving(after) - moving(before)
    assert set(added) <= {"all-gather"} and moving(before) - moving(after) == {}
    assert added["all-gather"] <= 15  # 7 GEMMs in each of 2 layers, and the logits
    assert set(scalar(after) - scalar(before)) == {"all-reduce"}

    saving = ("enable_checkpointing=True", "async_checkpointing=False", "checkpoint_period=1")
    train(maxtext_python, tmp_path, "parts", "steps=2", *saving, *nvfp4)
    train(maxtext_python, tmp_path, "parts", "steps=3", *saving, *nvfp4,
          "fp4lab.probes=all")  # resumes, and reports its probes
    parts = losses(tmp_path, "parts")
    assert parts[-1] == whole[-1] and parts[:2] == whole[:2]
    probes_are_reported(tmp_path / "parts.jsonl")
    items = [str(tmp_path / "parts" / "checkpoints" / str(step) / "items") for step in (0, 1)]
    got = subprocess.run([str(maxtext_python), "-c", COUNTS, *items], capture_output=True,
                         text=True, check=True, env=_env(4))
    counts = got.stdout.splitlines()[-2:]
    assert counts == ["[1, 1] 2", "[2, 2] 2"]  # one draw a step, one stream per block

    cmd = [str(maxtext_python), "-m", "fp4lab.integrations.maxtext",
           *[a.replace("skip_jax_distributed_system=True", "skip_jax_distributed_system=False")
             for a in TINY], f"base_output_directory={tmp_path}", "run_name=two", "steps=1",
           "jax_cache_dir=", *nvfp4]  # (no cache: two processes)
    logs = [tmp_path / f"two{i}.log" for i in range(2)]  # files: a full pipe would block
    # every process writes MaxText's metrics_file (truncated at step 0, then appended): one
    # file each, or two processes race on one and it may hold the step twice
    procs = [subprocess.Popen([*cmd, f"metrics_file={tmp_path}/two{i}.jsonl"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path,
                              env=_env(2, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                                       JAX_COORDINATOR_ADDRESS="127.0.0.1", JOB_INDEX="0",
                                       JOB_COMPLETION_INDEX=str(i), PROCESSES_IN_JOB="2",
                                       JAX_PROCESS_COUNT="2"))
             for i, log in enumerate(logs)]
    for p in procs:
        p.wait(timeout=900)
    logs = [log.read_text() for log in logs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    assert all("Jax process id is" in log for log in logs)
    assert losses(tmp_path, "two0") == losses(tmp_path, "two1") == whole[:1]


@pytest.mark.slow
def test_maxtexts_moe_follows_nemotron3_on_an_expert_parallel_mesh(maxtext_python, tmp_path):
    """MaxText's dense MoE path (``sparse_matmul=False``: its experts are einsums, which
    fp4lab governs as expert stacks) on an fsdp 2 x expert 2 mesh under ``nemotron3``, the
    preset meaning what it means on the hybrid LM: ``explain`` lists each layer's three
    expert stacks, block 0's in NVFP4 and block 1's in BF16 (the last 15 %), the attention
    projections and the logits layer BF16, the router left as written (the README's command
    runs the same preset on MaxText's ragged_dot path, which the combined test trains); it trains within a few percent of
    MaxText's own losses, and its compiled step moves what MaxText's does: the same
    all-to-alls, all-reduces that add the per-expert amaxes (a few dozen elements) and
    under 5 % more all-gathered elements (measured: +1.8 %, the quantized copies of FSDP's
    gathered expert weights)."""
    mesh = ("ici_tensor_parallelism=1", "ici_expert_parallelism=2", "sparse_matmul=False",
            "scan_layers=False", "steps=3")
    train(maxtext_python, tmp_path, "own", *MOE, *mesh, module="maxtext.trainers.pre_train.train",
          dump=True)
    run = train(maxtext_python, tmp_path, "moe", *MOE, *mesh, "fp4lab.policy=nemotron3",
                dump=True)
    recipes = {path: recipe for path, (_, recipe) in table(run.stdout).items()}
    for i in range(3):
        assert recipes[f"decoder/layers_0/MoeBlock_0/expert_einsum_{i}"] == "nvfp4"
        assert recipes[f"decoder/layers_1/MoeBlock_0/expert_einsum_{i}"] == "bf16"  # the tail
    assert recipes["decoder/layers_0/self_attention/query"] == "bf16"
    assert recipes["decoder/logits_dense"] == "bf16"
    assert not any("gate" in path for path in recipes)
    base, got = losses(tmp_path, "own"), losses(tmp_path, "moe")
    assert got != base and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, base, rtol=0.03)
    before, after = (step_moved(tmp_path, n) for n in ("own", "moe"))
    assert after["all-to-all"] == before["all-to-all"] > 0  # MaxText's expert dispatch
    assert 0 < after["all-reduce"] - before["all-reduce"] <= 64  # per-expert amaxes
    assert before["all-gather"] < after["all-gather"] < 1.05 * before["all-gather"]


def refusal(run: subprocess.CompletedProcess) -> str:
    """The one line of a refusal: stderr's last line ``error: ...`` (after MaxText's own
    logging), exit status 1, no traceback and no JAX traceback note anywhere, the message
    printed once."""
    assert run.returncode == 1, run.stderr[-6000:]
    assert "Traceback" not in run.stderr and "JAX has removed" not in run.stderr, \
        run.stderr[-6000:]
    line = run.stderr.rstrip("\n").splitlines()[-1]
    assert line.startswith("error: ") and run.stderr.count(line.removeprefix("error: ")) == 1
    return line


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["scan_layers=True", "fp4lab.policy=nemotron3"],
     ["policy nemotron3: decoder/layers/mlp/wi_0 is 2 blocks stacked for a scan",
      "(0: nvfp4, 1: bf16)", "scan_layers=False"]),
    ([*MOE, "megablox=True", "fp4lab.policy=all:nvfp4"],
     ["megablox=True computes MaxText's experts (num_experts=4)", "megablox=False"]),
    (["fp4lab.policy=file:missing.json"],  # refused on the command line, before MaxText
     ["policy file 'missing.json' does not exist"]),
], ids=["nemotron3-scanned", "megablox", "policy-file"])
def test_refusals_of_the_models_build_are_one_line(maxtext_python, tmp_path, args, says):
    """What fp4lab refuses while MaxText builds the model prints as the command line's
    refusals do (fp4lab.integrations.maxtext.is_refusal): one line naming the value, no
    traceback."""
    line = refusal(train(maxtext_python, tmp_path, "refused", "steps=1", *args, check=False))
    for text in says:
        assert text in line, line
    assert not (tmp_path / "refused.jsonl").exists()  # refused before any step


@pytest.mark.slow
def test_maxtexts_own_errors_keep_their_traceback(maxtext_python, tmp_path):
    """A ValueError that is not fp4lab's (MaxText's config validation, a pydantic
    ValidationError) is no refusal: it crashes with its traceback, as MaxText prints it."""
    run = train(maxtext_python, tmp_path, "bogus", "steps=1", "quantization=bogus",
                "fp4lab.policy=all:nvfp4", check=False)
    assert run.returncode == 1 and "Traceback" in run.stderr
    assert "ValidationError" in run.stderr and "input_value='bogus'" in run.stderr
    assert not any(line.startswith("error: ") for line in run.stderr.splitlines())


def test_only_a_raise_in_fp4lab_is_a_refusal():
    """fp4lab.integrations.maxtext's rule: a ValueError (FileNotFoundError, ImportError) raised by a
    ``raise`` in fp4lab's source is a refusal, also inside a JAX trace; the same types raised
    by JAX (under jit too, where JAX filters the traceback), and other types raised by
    fp4lab, are not."""
    import jax.numpy as jnp

    from fp4lab.flax.nnx import register_layer
    from fp4lab.integrations.maxtext import is_refusal
    from fp4lab.policy import get_policy
    from fp4lab.gemm.qdot import qdot_general
    from fp4lab.numerics.quantize import straight_through

    def caught(f):
        try:
            f()
        except Exception as e:  # noqa: BLE001 - the exception is the result
            return e
        raise AssertionError("no exception")

    assert is_refusal(caught(lambda: get_policy("nvfp5")))
    assert is_refusal(caught(lambda: get_policy("file:missing.json")))  # FileNotFoundError
    assert is_refusal(caught(lambda: jax.jit(straight_through)(jnp.ones(4), jnp.ones(3))))
    dims = (((1,), (0,)), ((), ()))
    assert is_refusal(caught(lambda: jax.jit(lambda a, b: qdot_general(a, b, dims, "bf16"))(
        jnp.ones((4, 16)), jnp.ones((15, 4)))))  # "lhs axis 1 (size 16) and rhs axis 0 ..."
    assert not is_refusal(caught(lambda: jnp.broadcast_to(jnp.ones(3), (4,))))
    assert not is_refusal(caught(lambda: jax.jit(lambda x: jnp.broadcast_to(x, (4,)))(
        jnp.ones(3))))
    assert not is_refusal(caught(lambda: register_layer(int, "dense")))  # TypeError
    assert not is_refusal(ValueError("never raised"))


COUNTS = """
import sys, numpy as np, orbax.checkpoint as ocp
for items in sys.argv[1:]:
    state = ocp.PyTreeCheckpointer().restore(items)
    decoder = state["nnx_aux"]["model"]["decoder"]
    wo = decoder["layers"]["MoeBlock_0"]["fp4lab_ops"]["ragged_dot_2"]
    print(np.asarray(wo["sr_count"]).tolist(), len({tuple(k) for k in np.asarray(wo["sr_key"])}))
"""


def probes_are_reported(metrics_file: Path) -> None:
    from fp4lab.numerics.metrics import METRIC_NAMES
    from fp4lab.gemm.recipe import OPERANDS

    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    steps = [step for step in steps if any(k.startswith("fp4lab/") for k in step)]
    assert steps, f"no probes in {metrics_file}"
    gemms = [f"decoder/layers/{g}[{i}]" for i in range(2) for g in (
        "self_attention/query", "self_attention/key", "self_attention/value",
        "self_attention/out")] + ["decoder/logits_dense"] + [
        f"decoder/layers/MoeBlock_0/ragged_dot_{g}[{i},{e}]" for g in range(3)
        for i in range(2) for e in range(4)]  # each block's each expert
    want = {f"fp4lab/{g}/{op}/{m}" for g in gemms for op in OPERANDS for m in METRIC_NAMES}
    for step in steps:
        assert {k for k in step if k.startswith("fp4lab/")} == want
        assert all(np.isfinite(step[k]) for k in want if not k.endswith("sqnr_db"))
        assert all(0 <= step[k] <= 1 for k in want if k.endswith("underflow"))
        assert 5 < step["fp4lab/decoder/layers/MoeBlock_0/ragged_dot_2[1,0]/fprop_x/sqnr_db"] < 40
    wo = "fp4lab/decoder/layers/MoeBlock_0/ragged_dot_2"
    assert steps[0][f"{wo}[0,0]/wgrad_dy/mse"] != steps[0][f"{wo}[1,0]/wgrad_dy/mse"]
    assert steps[0][f"{wo}[0,0]/wgrad_dy/mse"] != steps[0][f"{wo}[0,1]/wgrad_dy/mse"]


def test_a_missing_maxtext_is_one_line_naming_the_install(tmp_path):
    """In an environment without MaxText (this one), the command says how to install it."""
    if importlib.util.find_spec("maxtext") is not None:
        pytest.skip("this environment has MaxText")
    run = subprocess.run([sys.executable, "-m", "fp4lab.integrations.maxtext", "base.yml",
                          "steps=1"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: fp4lab.integrations.maxtext needs MaxText")
    assert "scripts/maxtext-venv" in run.stderr


class TinyLM(nnx.Module):  # MaxText's Transformer's call signature, on two NNX layers
    def __init__(self, rngs):
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.mlp = nnx.Linear(32, 32, rngs=rngs)
        self.head = nnx.Linear(32, 256, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids, enable_dropout=True):
        return self.head(jax.nn.relu(self.mlp(self.embed(tokens))))


def config(**kw):
    return SimpleNamespace(**{"quantization": "", "micro_batch_size_to_train_on": 2,
                              "max_target_length": 8, "mtp_num_layers": 0,
                              "gradient_accumulation_steps": 1, "num_experts": 1,
                              "sparse_matmul": True, "megablox": True,
                              "use_tokamax_gmm": False, **kw})


def test_what_maxtexts_train_step_cannot_serve_is_refused():
    """Delayed scaling rolls each amax history from its gradient, which MaxText's step never
    computes for state other than parameters: refused, not run with frozen histories; and
    MaxText's own quantization alongside a policy is refused too."""
    with pytest.raises(ValueError, match="fp8_delayed \\(delayed scaling\\).*fp8_hybrid"):
        quantize(TinyLM(nnx.Rngs(0)), config(), Options(policy="all:fp8_delayed"))
    with pytest.raises(ValueError, match="quantization='int8'.*would both quantize"):
        quantize(TinyLM(nnx.Rngs(0)), config(quantization="int8"), Options(policy="all:nvfp4"))
    with pytest.raises(ValueError, match="tetrajet_v2_outcontrol has OutControl.*Linen"):
        quantize(TinyLM(nnx.Rngs(0)), config(), Options(policy="all:tetrajet_v2_outcontrol"))
    with pytest.raises(ValueError, match="probes='all'.*gradient_accumulation_steps=4"):
        quantize(TinyLM(nnx.Rngs(0)), config(gradient_accumulation_steps=4),
                 Options(policy="all:nvfp4", probes="all"))
    m = quantize(TinyLM(nnx.Rngs(0)), config(), Options(policy="all:nvfp4"))
    assert [a.recipe.name for a in assignments(m)] == ["nvfp4", "nvfp4"]
    # experts in MaxText's kernels: out of the policy's reach, refused by name
    for kw, says in [({}, "megablox=True computes MaxText's experts .* set megablox=False"),
                     ({"megablox": False, "use_tokamax_gmm": True}, "use_tokamax_gmm=True")]:
        with pytest.raises(ValueError, match=says):
            quantize(TinyLM(nnx.Rngs(0)), config(num_experts=4, **kw), Options())
    for kw in ({"megablox": False}, {"sparse_matmul": False}):
        quantize(TinyLM(nnx.Rngs(0)), config(num_experts=4, **kw), Options())
