"""experiments.runinfo: what a run ran on (versions, git commit, devices, host, start time), and
the records of a process that does not write (a multi-process run's processes other than 0).
That train() writes it to run_info.json and result.json is in test_distributed."""

import datetime
import importlib.metadata
import json
import platform
import shutil
import socket
import subprocess

import jax
import pytest

from experiments import runinfo
from experiments.records import RunRecords


def test_versions_are_the_installed_ones():
    versions = runinfo.package_versions()
    assert set(versions) == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
                             "ml_dtypes", "fp4lab", "python"}
    for name in runinfo.PACKAGES:
        assert versions[name] == importlib.metadata.version(name), name
    assert versions["jax"] == jax.__version__
    assert versions["python"] == platform.python_version()
    assert runinfo.package_versions(("no-such-distribution-here",)) == {
        "no-such-distribution-here": None, "python": platform.python_version()}


def _git(*args):
    return subprocess.run(["git", *args], cwd=runinfo.REPO_ROOT, capture_output=True,
                          text=True, check=False, timeout=10)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_commit_is_the_checkouts_head():
    head = _git("rev-parse", "HEAD")
    if head.returncode:
        pytest.skip("not running from a git checkout")
    state = runinfo.git_state()
    assert state["commit"] == head.stdout.strip() and len(state["commit"]) == 40
    assert state["dirty"] is bool(_git("status", "--porcelain").stdout.strip())


def test_no_checkout_or_no_git_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repo above it
    assert runinfo.git_state(tmp_path) == {"commit": None, "dirty": None}
    assert runinfo.git_state(tmp_path / "missing") == {"commit": None, "dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert runinfo.git_state() == {"commit": None, "dirty": None}


def test_devices_and_processes():
    info = runinfo.device_info()
    assert info == {"platform": jax.devices()[0].platform,
                    "device_kind": jax.devices()[0].device_kind,
                    "local_device_count": jax.local_device_count(),
                    "device_count": jax.device_count(),
                    "process_count": jax.process_count(), "process_index": jax.process_index()}
    assert info["device_count"] >= info["local_device_count"] >= 1
    assert (info["process_count"], info["process_index"]) == (1, 0)


def test_collect_records_everything_as_json(tmp_path):
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    info = runinfo.collect({"seed": 0, "train": {"steps": 3}}, start_step=2)
    started = datetime.datetime.fromisoformat(info["started_utc"])
    assert started.utcoffset() == datetime.timedelta(0)
    assert before <= started <= datetime.datetime.now(datetime.UTC)
    assert info["hostname"] == socket.gethostname() and isinstance(info["pid"], int)
    assert info["config"] == {"seed": 0, "train": {"steps": 3}} and info["start_step"] == 2
    assert info["versions"] == runinfo.package_versions()
    assert info["git"] == runinfo.git_state()
    assert info["device_count"] == jax.device_count()
    assert isinstance(info["command"], list) and isinstance(info["os"], str)
    records = RunRecords(tmp_path)
    records.write_run_info(info)
    assert json.loads((tmp_path / "run_info.json").read_text()) == info
    assert [p.name for p in tmp_path.iterdir()] == ["run_info.json"]  # no temporary left


def test_records_that_do_not_write_read_the_writers_files(tmp_path):
    writer, reader = RunRecords(tmp_path), RunRecords(tmp_path, write=False)
    with writer:
        writer.steps([{"step": 0, "loss": 2.0}])
    with reader:  # no TensorBoard writer, no files
        reader.start_fresh()
        reader.steps([{"step": 1, "loss": 1.0}])
        reader.val_loss(1, 1.5, 2)
        reader.write_config({"seed": 1}, 0, {"seed": (0, 1)})
        reader.write_run_info({"x": 1})
        reader.write_result({"status": "ok"})
        reader.keep_before(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]
    assert reader.read("loss") == [{"step": 0, "loss": 2.0}]
