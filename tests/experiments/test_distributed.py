"""experiments.train --distributed, for real: two CPU processes on this machine (a local
coordinator, gloo collectives, two simulated devices each) train the tiny config (one of them
reaching its first step 40 s after the other), stop on a Ctrl-C that reached only one of
them, resume, and end bit-identical to one process with the same four devices and the same
(gloo) collectives (docs/experiments.md, "Multi-process runs", says how a plain run with
XLA's in-process collectives differs)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.records import read_jsonl

ROOT = Path(__file__).parents[2]
# How long a process waits for its peers (--distributed-timeout): generous, since on a loaded
# 2-core machine (CI) three training processes share the cores, and the cold compile of a
# step alone can take a minute. A peer that never comes still fails the run, with its error,
# within the test's own deadline, which is longer still.
DISTRIBUTED_TIMEOUT_S = 600
TIMEOUT_S = 900  # for the whole test: every process left after it is killed
# gloo gives the peers of a group of devices 30 s to connect (experiments.train
# _connect_collectives): process 1 of the first run builds its first step this much later
# than process 0, which waits for it in the step's all-reduce (as for a peer that compiles
# slowly); before the groups were connected up front, process 0 failed after 30 s
# ("DEADLINE_EXCEEDED: GetKeyValue() timed out").
LATE_STEP_S = 40

# The training command line with a Ctrl-C before step 3 in process 0 only (delivered
# synchronously to the handler the run installed, as in test_train): the processes must agree
# to stop after the same step (the next log step, 4) and save that checkpoint together. And
# process 1 builds its first step LATE_STEP_S late.
INTERRUPTED = f"""
import signal, sys, time
import jax
from experiments import data, loop, train
real_batch, real_make_step = data.TextData.batch, loop.make_step
def batch(self, seed, step, batch_size, seq_len):
    if step == 3 and jax.process_index() == 0:
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    return real_batch(self, seed, step, batch_size, seq_len)
built = []
def make_step(*args, **kwargs):
    if jax.process_index() == 1 and not built:
        time.sleep({LATE_STEP_S})
    built.append(1)
    return real_make_step(*args, **kwargs)
data.TextData.batch, loop.make_step = batch, make_step
sys.exit(train.main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Python subprocesses in the checkout, each in its own process group with its own
    simulated CPU devices; output to ``logs/<name>.log``; one deadline for all of them."""

    def __init__(self, logs: Path, timeout_s: float):
        self.logs, self.deadline, self.started = logs, time.monotonic() + timeout_s, {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], devices: int) -> str:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        with (self.logs / f"{name}.log").open("w") as log:
            self.started[name] = subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return name

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait(self, *names: str) -> list[int]:
        """Their exit codes, once all have exited. One that fails (its partners would wait
        for it in a collective) or the deadline ends the test: the rest are killed."""
        procs = [self.started[n] for n in names]
        while any(p.poll() is None for p in procs):
            failed = [n for n, p in zip(names, procs, strict=True) if p.poll() not in (None, 0, 130)]
            late = time.monotonic() > self.deadline
            if failed or late:
                self.kill_all()
                why = f"{failed} failed" if failed else f"still running after {TIMEOUT_S} s"
                tails = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.started)
                pytest.fail(f"{why}\n{tails}")
            time.sleep(0.2)
        return [p.returncode for p in procs]

    def kill_all(self):
        for p in self.started.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the process and anything it started
                except ProcessLookupError:
                    pass
                p.wait()


@pytest.fixture
def processes(tmp_path):
    ps = Processes(tmp_path / "logs", TIMEOUT_S)
    try:
        yield ps
    finally:
        ps.kill_all()


def train_args(workdir: Path, corpus_dir, cache: str) -> list[str]:
    return ["--config", "tiny", "--workdir", str(workdir), f"data.paths=('{corpus_dir}',)",
            f"compile_cache={cache}", "probes.every=0", "train.ckpt_every=0", "train.steps=8",
            "model.pattern=-"]  # one MLP block: the test is the processes' protocol


def distributed(num_processes: int, process_id: int, port: int) -> list[str]:
    return ["--distributed", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", str(num_processes), "--process-id", str(process_id),
            "--distributed-timeout", str(DISTRIBUTED_TIMEOUT_S)]


def step_lines(workdir: Path) -> list[dict]:
    """The metrics lines without the throughput (the one thing allowed to differ)."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"}
            for r in read_jsonl(workdir / "metrics.jsonl")]


def checkpoint_leaves(path: Path) -> list[np.ndarray]:
    """Every array of a checkpoint, restored on one device whatever topology saved it."""
    import jax
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    meta = ckpt.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(path, like))]


@pytest.mark.slow
def test_two_processes_train_stop_and_resume_exactly_as_one(tmp_path, corpus_dir, tiny,
                                                           processes):
    train = ["-m", "experiments.train"]
    ref, two = tmp_path / "ref", tmp_path / "two"
    # one process with all four devices, through gloo (a one-process "cluster")
    processes.start("ref", [*train, *train_args(ref, corpus_dir, tiny.compile_cache),
                            *distributed(1, 0, free_port())], devices=4)
    port = free_port()
    first = [processes.start(f"first{i}", ["-c", INTERRUPTED,
                                           *train_args(two, corpus_dir, tiny.compile_cache),
                                           *distributed(2, i, port)], devices=2)
             for i in range(2)]
    assert processes.wait(*first) == [130, 130]  # both stopped, after the same step
    for name in first:
        assert "interrupted after step 4 of 8" in processes.log(name)
    assert sorted(p.name for p in (two / "ckpt").iterdir()) == ["4"]
    port = free_port()  # the same command again (without the Ctrl-C): resumes
    again = [processes.start(f"again{i}", [*train, *train_args(two, corpus_dir,
                                                               tiny.compile_cache),
                                           *distributed(2, i, port)], devices=2)
             for i in range(2)]
    assert processes.wait(*again, "ref") == [0, 0, 0]

    # bit-identical to the one-process run: every metric, the result, the final state
    assert [r["step"] for r in step_lines(two) if "loss" in r] == list(range(8))
    assert step_lines(two) == step_lines(ref)
    result, ref_result = (json.loads((d / "result.json").read_text()) for d in (two, ref))
    for key in ("val_loss", "final_train_loss", "tokens", "devices"):
        assert result[key] == ref_result[key], key
    final = [checkpoint_leaves(d / "ckpt" / "8" / "default") for d in (two, ref)]
    assert len(final[0]) == len(final[1]) > 20
    assert all(np.array_equal(a, b) for a, b in zip(final[0], final[1], strict=True))

    # process 0 alone wrote the files; what the run ran on, both starts of it
    assert not list(two.glob("process_*")) and len(list((two / "tb").iterdir())) >= 1
    info = json.loads((two / "run_info.json").read_text())
    assert result["run_info"] == info
    assert (info["process_count"], info["process_index"], info["device_count"],
            info["local_device_count"], info["start_step"]) == (2, 0, 4, 2, 4)
    assert [e["start_step"] for e in info["earlier"]] == [0]
    assert "--process-id" in info["command"]
    assert ref_result["run_info"]["process_count"] == 1



def test_the_distributed_timeout_is_checked_before_anything_starts(tmp_path, capsys):
    """--distributed-timeout needs --distributed and a positive number of seconds: a usage
    error (exit status 2) before JAX joins or starts anything; the same in Python."""
    from experiments.processes import initialize_distributed
    from experiments.train import main

    for argv, message in ((["--distributed-timeout", "600"], "need --distributed"),
                          (["--distributed", "--distributed-timeout", "0"], "positive number"),
                          (["--distributed", "--distributed-timeout", "inf"], "positive number")):
        with pytest.raises(SystemExit) as e:
            main(["--workdir", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    with pytest.raises(ValueError, match="positive number of seconds"):
        initialize_distributed("127.0.0.1:1", 2, 0, timeout_s=-1)
    assert not (tmp_path / "run").exists()
