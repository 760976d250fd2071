"""experiments.memory: the estimate of a training step's memory, and the refusal of a config
whose step would not fit, before anything is initialized or compiled."""

import dataclasses
import re

import jax
import pytest

from experiments.configs import CONFIG_DIR, load_config
from experiments.memory import check_memory, step_bytes
from experiments.step import model_config

GIB = 2**30


def test_seq_len_100000_is_refused_in_one_line_before_compiling(tmp_path, capsys):
    """The issue's command: the default corpus holds 100000-token sequences, so only the
    memory check stands between it and compiling a step of terabytes. One line, exit 2,
    nothing written."""
    from experiments import train as train_module

    workdir = tmp_path / "run"
    assert train_module.main(["--config", "default", "--workdir", str(workdir),
                              "data.seq_len=100000"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(
        r"error: data\.seq_len=100000 with data\.batch_size=8: the training step needs an "
        r"estimated [\d.]+ TiB( per device)? \(attention scores [\d.]+ TiB, Mamba-2 scan "
        r"states [\d.]+ GiB\), more than the [\d.]+ [KMGT]iB of .*available.*; lower "
        r"data\.seq_len or data\.batch_size; model\.attention='flash' keeps no seq_len\^2 "
        r"scores", err.strip()), err
    assert not workdir.exists()


def test_the_refusal_names_the_values_the_estimate_and_the_memory():
    """On one CPU device (the batch and one state in one memory), against 1 GiB."""
    c = load_config("tiny", ["data.seq_len=4096"])
    cfg, one = model_config(c), dict(devices=jax.local_devices()[:1],
                                     available=(GIB, "host memory available (MemAvailable)"))
    with pytest.raises(ValueError) as e:
        check_memory(c, cfg, 1, **one)
    assert str(e.value) == (
        "data.seq_len=4096 with data.batch_size=8: the training step needs an estimated "
        "6.3 GiB (attention scores 5.0 GiB, Mamba-2 scan states 788.0 MiB), more than the "
        "1.0 GiB of host memory available (MemAvailable); lower data.seq_len or "
        "data.batch_size; model.attention='flash' keeps no seq_len^2 scores")
    flash = dataclasses.replace(cfg, attention="flash")  # no seq_len^2 term, no hint
    with pytest.raises(ValueError, match=r"estimated 1\.4 GiB \(Mamba-2 scan states 788\.0 "
                                         r"MiB, logits 192\.0 MiB\), more than the 1\.0 GiB "
                                         r"of host .* data\.batch_size$"):
        check_memory(c, flash, 1, **one)
    check_memory(c, flash, 1, devices=one["devices"], available=(2 * GIB, "x"))  # fits


def _project_configs():
    """Every run of every config in experiments/configs (a sweep's: each planned run), and
    the tiny config as the tests train it."""
    from experiments.sweep.plan import planned_runs, run_config

    for path in sorted(CONFIG_DIR.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        c = load_config(path.stem)
        if "sweep" in c:
            for run in planned_runs(c):
                yield f"{path.stem}:{run.name}", run_config(c, run)
        else:
            yield path.stem, c
    yield "tiny (mtp, flash)", load_config("tiny", ["model.mtp=True", "model.attention=flash"])


def test_every_config_the_project_runs_is_accepted():
    """No config the project trains comes near a refusal: each step's estimate (on the
    tests' 8 CPU devices, each with a copy of the state) is under 2 GiB, and the check
    accepts it against this machine's memory."""
    n = len(jax.devices())
    names = []
    for name, c in _project_configs():
        cfg = model_config(c)
        if c.data.tokens:  # bpe.py: the 4096-token BPE its token files' folder names
            assert "bpe4096" in c.data.tokens, (name, c.data.tokens)
            cfg = dataclasses.replace(cfg, vocab=max(cfg.vocab, 4096))
        local = len(jax.local_devices())
        need = sum(step_bytes(cfg, batch=c.data.batch_size * local // n, seq_len=c.data.seq_len,
                              replicas=local).values())
        assert need < 2 * GIB, (name, need)
        check_memory(c, cfg, n)
        names.append(name)
    assert len(names) > 100 and "default" in names and "bpe:bf16-seed0" in names


@pytest.mark.slow
def test_the_estimate_bounds_xlas_memory_analysis_of_the_step(tiny, text):
    """The estimate is above what XLA's buffer assignment of tiny's compiled training step
    holds (temporaries and arguments), and within twice it: an estimate, but of the right
    terms."""
    from experiments.step import make_step
    from experiments.run_spec import specify
    from experiments.setup import build

    setup = build(specify(tiny, text))
    step = make_step(setup.qmodel, setup.tx, setup.sched, tiny.seed, tiny.train.mtp_weight,
                     setup.features, setup.modes(setup.qmodel, 0), setup.spec.grad_reduce,
                     setup.place.batch.mesh)
    b = text.batch(tiny.seed, 0, tiny.data.batch_size, tiny.data.seq_len)
    compiled = step.func.lower(setup.state, *setup.place.put(b), **step.keywords).compile()
    m = compiled.memory_analysis()
    held = m.temp_size_in_bytes + m.argument_size_in_bytes  # one device's
    estimate = sum(step_bytes(model_config(tiny, text),
                              batch=tiny.data.batch_size // len(jax.devices()),
                              seq_len=tiny.data.seq_len).values())
    assert held <= estimate <= 2 * held, (held, estimate)
