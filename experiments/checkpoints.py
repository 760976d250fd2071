"""A run's checkpoints: orbax saves of its TrainState (the latest two kept), the
parameters read alone (:func:`restore_params`), and resuming a stored run only with the
config it trained under (or the changes allowed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax

from experiments.records import RunRecords
from experiments.run_spec import describe_changes, stored_changes
from experiments.run_files import restore_checkpoint
from experiments.setup import Setup
from experiments.step import TrainState

__all__ = ["Checkpoints", "restore_params", "resume"]


class Checkpoints:
    """orbax checkpoints of the TrainState in ``workdir/ckpt`` (the latest two kept)."""

    def __init__(self, workdir: Path):
        import orbax.checkpoint as ocp

        self._ocp, self.dir = ocp, workdir / "ckpt"
        self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, *, force: bool = False, wait: bool = False):
        self.manager.save(step, args=self._ocp.args.StandardSave(state), force=force)
        if wait:
            self.wait()

    def wait(self):
        """Until the saves in flight are on disk."""
        self.manager.wait_until_finished()

    def restore(self, like: TrainState) -> TrainState:
        """The latest checkpoint (damaged files: one line, ``run_files.restore_checkpoint``)."""
        abstract = jax.tree.map(self._ocp.utils.to_shape_dtype_struct, like)
        step = self.latest()
        return restore_checkpoint(self.dir.parent, step, lambda: self.manager.restore(
            step, args=self._ocp.args.StandardRestore(abstract)))

    def restore_params(self, like: dict) -> dict:
        """The latest checkpoint's ``TrainState.params`` alone (see :func:`restore_params`)."""
        ocp, device = self._ocp, jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(dtype=a.dtype, sharding=device), like)
        step = self.latest()
        return restore_checkpoint(self.dir.parent, step, lambda: self.manager.restore(
            step, args=ocp.args.PyTreeRestore(item={"params": like}, restore_args={
                "params": args}, partial_restore=True)))["params"]

    def remove_partial(self):
        """What an interrupted save may have left behind."""
        for tmp_dir in self.dir.glob("*orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp_dir, ignore_errors=True)


def restore_params(workdir, like: dict) -> dict:
    """The parameters (``TrainState.params``) of the latest checkpoint of the run in
    ``workdir``, read alone: no optimizer or other state is built or read. ``like`` is their
    tree of shapes and dtypes (``jax.eval_shape`` of the model's init); the arrays come back
    on the default device. FileNotFoundError if ``workdir`` holds no checkpoint."""
    workdir = Path(workdir).resolve()  # orbax reads absolute paths only
    ckpt = Checkpoints(workdir) if (workdir / "ckpt").is_dir() else None
    if ckpt is None or ckpt.latest() is None:
        raise FileNotFoundError(f"{str(workdir)!r} has no checkpoint to read parameters from")
    return ckpt.restore_params(like)


def _check_resume(workdir: Path, setup: Setup, allow_changes) -> dict:
    """The config changes of a resumed run: refused unless every changed key is allowed (by
    its dotted name or its section, e.g. ``train``)."""
    changes = stored_changes(workdir, setup.spec.record, setup.spec.data) or {}
    allowed = set(allow_changes)
    refused = {k: v for k, v in changes.items()
               if k not in allowed and k.split(".")[0] not in allowed}
    if refused:
        raise ValueError(
            f"{workdir} holds {describe_changes(refused, setup.spec.config.precision.policy)}; "
            "resuming it would blend two runs. Use another --workdir, remove this one, or "
            f"continue this run with the new values: --allow-changes {','.join(refused)}")
    return changes


def resume(ckpt: Checkpoints, records: RunRecords, setup: Setup, allow_changes) -> TrainState:
    """The state to start from: the latest checkpoint's (the metrics written after it are
    dropped) or the initial one for a new run; writes ``config.json`` and the changes."""
    start, changes, state = 0, {}, setup.state
    if ckpt.latest() is not None:
        changes = _check_resume(records.out, setup, allow_changes)
        state = ckpt.restore(state)
        start = int(state.step)
        records.keep_before(start)
    else:
        records.start_fresh()
    records.write_config(setup.spec.record, start, changes)
    return state
