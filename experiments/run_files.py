"""The one place a run's own files are read back, by ``experiments.runs.load_run`` and by
training (a resumed run, :func:`experiments.checkpoints.restore_params`): :func:`read_run_json`
reads ``config.json`` (and ``run_info.json``, ``result.json``), and every restore of a
checkpoint goes through :func:`restore_checkpoint`. A damaged or incomplete run (a file cut
short by a full disk or an interrupted copy, data files emptied or deleted) is then one
ValueError line naming the run and the damaged file, and what can still be done (an intact
earlier step, the copy of the config in ``run_info.json``), where orbax and TensorStore
would raise a ``JSONDecodeError`` without the file's name or a page of TensorStore spec.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["read_run_json", "check_checkpoint", "restore_checkpoint"]

T = TypeVar("T")

_JSON_REMEDY = {
    "run_info.json": "it only records what the run ran on: remove it to resume the run",
}


def read_run_json(workdir, name: str):
    """The JSON file ``name`` of the run in ``workdir`` (``config.json``, ``run_info.json``)
    as written. One that does not parse (cut short by a full disk or an interrupted copy) is
    a ValueError naming the run and the file, and what to do (``config.json``: the copy of
    the config in ``run_info.json``), not ``json``'s "Expecting value: line 7" alone."""
    workdir = Path(workdir)
    try:
        return json.loads((workdir / name).read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        remedy = _JSON_REMEDY.get(name) or _config_remedy(workdir, name)
        raise ValueError(f"run {str(workdir)!r}: its {name} is damaged (cut short or not "
                         f"JSON: {e}); {remedy}") from None


def _config_remedy(workdir: Path, name: str) -> str:
    if name == "config.json":
        try:
            info = json.loads((workdir / "run_info.json").read_text())
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict) and isinstance(info.get("config"), dict):
            return ("run_info.json holds the same record under its \"config\" key: write "
                    "that back as config.json")
    return "copy the run again from where it was made, or train it again in a new folder"


def _checkpoint_damage(step_dir: Path) -> list[str]:
    """What is wrong with the files of the checkpoint in ``step_dir`` (``ckpt/<step>``, as
    orbax saved the TrainState there: ``default/``), each problem naming its file relative
    to ``step_dir``; empty if nothing is. Read: the JSON files orbax parses on restore and
    the OCDBT tree of the arrays (:func:`_ocdbt_damage`), not the arrays' bytes."""
    step_dir = step_dir.resolve()  # as TensorStore names the files
    item = step_dir / "default"
    if not item.is_dir():
        return ["its saved state (the folder default/) is missing"]
    problems = []
    for path in (item / "_METADATA", *sorted((item / "array_metadatas").glob("*"))):
        rel = path.relative_to(step_dir)
        if not path.is_file():
            problems.append(f"{rel} is missing")
            continue
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            problems.append(f"{rel} is cut short or not JSON ({e})")
    return problems + _ocdbt_damage(item, step_dir)


def _ocdbt_damage(item: Path, step_dir: Path) -> list[str]:
    """What is wrong with the OCDBT database in ``item`` (orbax's store of the arrays): its
    ``manifest.ocdbt`` must read, and every file its B+tree refers to, the tree's nodes and
    the arrays' data files (``d/<id>``, ``ocdbt.process_<i>/d/<id>``), must exist and hold
    the bytes referred to. TensorStore's ``ocdbt.dump`` reads the tree's nodes only; the
    data files are checked by their size. Orbax reads the files itself; checking first
    keeps TensorStore's errors (a thousand characters of spec, and its pending reads
    failing on a closed event loop after the first) from reaching the user."""
    manifest = item / "manifest.ocdbt"
    if not manifest.exists():  # not OCDBT: orbax's own error (restore_checkpoint) says it
        return []
    files = _OcdbtFiles(item, step_dir)
    if manifest.stat().st_size == 0:
        return [f"{files.rel(manifest)} is empty (0 bytes)"]
    import tensorstore as ts

    try:
        base = ts.KvStore.open({"driver": "file", "path": f"{item}/"}).result()
        versions = ts.ocdbt.dump(base).result()["versions"]
    except (ValueError, KeyError) as e:
        return [f"{files.rel(manifest)} cannot be read ({_tensorstore_reason(e, step_dir)})"]
    root = versions[-1]["root"].get("location") if versions else None
    files.walk(lambda location: ts.ocdbt.dump(base, location).result()["entries"], root)
    for path in list(files.need):
        files.check(path)
    return list(files.problems.values())


class _OcdbtFiles:
    """The files an OCDBT database's locations refer to (``need``: the bytes each must
    hold) and what is wrong with them (``problems``, one line per file)."""

    def __init__(self, item: Path, step_dir: Path):
        self.item, self.step_dir = item, step_dir
        self.need: dict[Path, int] = {}
        self.problems: dict[Path, str] = {}

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.step_dir))

    def file_of(self, location: str) -> Path | None:
        """The file a location (``<kind>:<base>:<path>:<offset>:<length>``) is in, its need
        recorded; None for a location of another form."""
        try:
            head, offset, length = location.rsplit(":", 2)
            base, _, path = head.split(":", 1)[1].partition(":")
            end = int(offset) + int(length)
        except (ValueError, IndexError):
            return None
        path = self.item / (base + path)
        self.need[path] = max(self.need.get(path, 0), end)
        return path

    def check(self, path: Path) -> bool:
        """Whether ``path`` exists and holds the bytes needed (else its problem recorded)."""
        if path in self.problems:
            return False
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            self.problems[path] = f"{self.rel(path)} is missing"
        elif size < self.need[path]:
            self.problems[path] = (f"{self.rel(path)} is " + ("empty" if size == 0 else
                                                              "cut short") +
                                   f" ({size} bytes; the checkpoint needs {self.need[path]})")
        return path not in self.problems

    def walk(self, entries_at, root: str | None):
        """The B+tree from ``root``: each node's file checked and read (``entries_at``), its
        subtrees followed and its arrays' data files recorded."""
        todo = [root] if root else []
        while todo:
            location = todo.pop()
            node = self.file_of(location)
            if node is None or not self.check(node):
                continue
            try:
                entries = entries_at(location)
            except (ValueError, KeyError) as e:
                self.problems[node] = (f"{self.rel(node)} cannot be read "
                                       f"({_tensorstore_reason(e, self.step_dir)})")
                continue
            for entry in entries:
                if "location" in entry:  # a subtree
                    todo.append(entry["location"])
                elif "indirect_value" in entry:  # an array's chunk, in a data file
                    self.file_of(entry["indirect_value"])


def _tensorstore_reason(e: BaseException, step_dir: Path | None = None) -> str:
    """The gist of a TensorStore error: its status and what it could not read (a file, or an
    array's chunk in the OCDBT database), without the spec it appends (``DATA_LOSS: d/32b8...:
    <why>``)."""
    text = str(e).split(" [tensorstore_spec", 1)[0]
    status = re.match(r"[A-Z_]+(?=: )", text)
    files = list(re.finditer(r'(?:local )?file "([^"]+)"(?:: )?', text))
    if not files:
        return text if len(text) < 200 else text[:200] + "..."
    last, name = files[-1], files[-1][1]
    why = text[last.end():].strip() or text[:last.start()].rsplit(": ", 1)[-1]
    key = re.search(r'Error reading "([^"]+)" in OCDBT', text)
    if name.endswith("/") and key:  # the database: the chunk it could not read
        what = f"the chunk {key[1]}"
    elif step_dir is not None and name.startswith(f"{step_dir}/"):
        what = name[len(str(step_dir)) + 1:]
    else:
        what = Path(name).name
    return f"{status[0] + ': ' if status else ''}{what}: {why}"[:300]


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit())


def check_checkpoint(workdir, step: int) -> None:
    """ValueError, one line naming the run, the step's folder and its damaged file, if
    checkpoint ``step`` of the run in ``workdir`` is damaged or incomplete
    (:func:`_checkpoint_damage`: its data files emptied or deleted, a metadata file cut
    short), saying what still can be done: an intact earlier step to read or resume from,
    once the damaged one is moved out of ``ckpt/``."""
    workdir = Path(workdir)
    ckpt = workdir / "ckpt"
    problems = _checkpoint_damage(ckpt / str(step))
    if not problems:
        return
    n = len(problems) - 1
    more = f" (and {n} more damaged file{'s' if n > 1 else ''})" if n else ""
    raise ValueError(f"run {str(workdir)!r}: checkpoint ckpt/{step} is damaged or "
                     f"incomplete: {problems[0]}{more}; {_step_remedy(ckpt, step)}")


def _step_remedy(ckpt: Path, step: int) -> str:
    """What to do about damaged step ``step``: an earlier intact one, if kept."""
    for earlier in reversed([s for s in _steps(ckpt) if s < step]):
        if not _checkpoint_damage(ckpt / str(earlier)):
            return (f"step {earlier} is intact: move {str(ckpt / str(step))!r} out of ckpt/ to "
                    f"read (or resume) the run from step {earlier}")
    return ("no intact earlier checkpoint is kept: copy the run again from where it was made, "
            "or train it again in a new folder")


def restore_checkpoint(workdir, step: int, restore: Callable[[], T]) -> T:
    """``restore()`` (orbax's restore of checkpoint ``step`` of the run in ``workdir``): every
    reader of a run's checkpoint goes through here (:func:`load_run`, a resumed training,
    ``experiments.checkpoints.restore_params``). First :func:`check_checkpoint`; then an error
    orbax or TensorStore raises about the step's files (damage the check cannot see, such as
    bytes changed in place) becomes the same one line, with what TensorStore could not read.
    The error is raised outside the handler, with no context: orbax's would keep its failed
    reads (frames, dropped coroutines) alive as long as the error lives."""
    workdir = Path(workdir)
    check_checkpoint(workdir, step)
    try:
        return restore()
    except Exception as e:  # orbax wraps TensorStore's ValueError in a bare Exception
        why = _read_failure(e, (workdir / "ckpt" / str(step)).resolve())
        if why is None:
            raise  # not about the files (a tree that does not fit, a bug): as it is
    raise ValueError(f"run {str(workdir)!r}: checkpoint ckpt/{step} is damaged or incomplete: "
                     f"it could not be read ({why}); {_step_remedy(workdir / 'ckpt', step)}")


def _read_failure(e: BaseException, step_dir: Path) -> str | None:
    """What ``e`` (or what it was raised from) says about the files of ``step_dir`` (as
    TensorStore names them: resolved), or None if it is about something else."""
    chain, x = [], e
    while x is not None and x not in chain:
        chain.append(x)
        x = x.__cause__ or x.__context__
    about = [x for x in chain if isinstance(x, (json.JSONDecodeError, FileNotFoundError))
             or str(step_dir) in str(x)]
    return _tensorstore_reason(about[-1], step_dir) if about else None
