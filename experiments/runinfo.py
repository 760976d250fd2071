"""What a run ran on: package versions, the checkout's git commit, devices, processes, host.

:func:`collect` gathers it all into one JSON-serializable dict; ``experiments.train`` writes it
to ``workdir/run_info.json`` (atomically, when the run starts) and into ``result.json`` under
``"run_info"``. Nothing here fails because something is missing: a package that is not
installed has version ``None``, and so has the commit of a folder that is not a git checkout
(or when git itself is missing or hangs).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["PACKAGES", "REPO_ROOT", "package_versions", "git_state", "device_info",
           "collect"]

# the distributions whose versions a run records (their names on PyPI)
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes",
            "fp4lab")
REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout experiments/ runs from


def package_versions(packages=PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution (None: not installed), and ``python``'s."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def _git(repo: Path, *args: str) -> str | None:
    """``git args`` in ``repo``: its stripped output, or None if git failed or is missing."""
    try:
        r = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                           check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, no folder, a timeout
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state(repo: str | Path = REPO_ROOT) -> dict:
    """``{"commit", "dirty"}`` of the checkout holding ``repo``: the HEAD commit and whether
    tracked or untracked (not ignored) files differ from it; both None outside a git
    checkout."""
    commit = _git(Path(repo), "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(Path(repo), "status", "--porcelain")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def device_info() -> dict:
    """The platform, device kind and counts (this process's and all processes'), and this
    process's place among the processes."""
    import jax

    local = jax.local_devices()
    return {"platform": local[0].platform, "device_kind": local[0].device_kind,
            "local_device_count": len(local), "device_count": jax.device_count(),
            "process_count": jax.process_count(), "process_index": jax.process_index()}


def collect(config: dict | None = None, *, repo: str | Path = REPO_ROOT, **extra) -> dict:
    """Everything above, with the host, the command line and the start time (UTC, ISO 8601);
    ``config`` (a plain dict) and ``extra`` keys are recorded as given."""
    return {
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "command": list(sys.argv),
        "os": platform.platform(),
        "versions": package_versions(),
        "git": git_state(repo),
        **device_info(),
        **extra,
        "config": config,
    }
