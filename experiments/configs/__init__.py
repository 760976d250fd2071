"""Experiment configs: ml_collections files with a ``get_config()``, plus ``key=value``
overrides from the command line (``train.steps=300``, ``data.paths=('a.txt',)``,
``precision.policy=nemotron3``). Values are parsed as Python literals when they parse, else
kept as strings; an override of a key the config does not have is an error.

Every key's default is set once, in ``default.py`` (the other configs start from it); code
indexes keys directly. A run stored before a key existed is read with the value it had
(:func:`with_defaults`): the default, or :data:`BEFORE_THE_KEY`'s where that differs.

(``ml_collections.config_flags`` would replace the ``key=value`` parser only by changing
every command line: its overrides are ``--config.train.steps=3`` flags, a bare
``train.steps=3`` is ignored, a key whose default is None (``data.tokens``,
``train.muon.mu_dtype``) cannot be overridden, its errors differ from the ones the commands
promise, and sweeps and notebooks apply overrides from Python, which it does not.)"""

from __future__ import annotations

import ast
import copy
import importlib.util
from pathlib import Path

import ml_collections

__all__ = ["load_config", "apply_overrides", "sweep_section", "config_changes",
           "format_changes", "describe_keys", "keys_help", "with_defaults", "BEFORE_THE_KEY",
           "CONFIG_DIR"]

CONFIG_DIR = Path(__file__).parent


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"fp4lab_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep_section(policies, **keys) -> ml_collections.ConfigDict:
    """A sweep config's ``sweep`` section (``experiments.sweep``): ``policies`` and, where
    given, ``seeds`` (a count, 1 by default, or a list of seeds), ``seeded_policies`` (those
    of the sweep's policies that run under every seed; () = all; a policy the sweep does not
    run selects nothing), ``sizes``, ``variants`` and ``compare`` (() each;
    docs/experiments.md)."""
    section = dict(policies=tuple(policies), seeds=1, seeded_policies=(), sizes=(),
                   variants=(), compare=())
    unknown = sorted(set(keys) - set(section))
    if unknown:
        raise KeyError(f"sweep_section: unknown keys {unknown}; known: {', '.join(section)}")
    section.update(keys)
    return ml_collections.ConfigDict(section, type_safe=False)  # seeds: an int or a tuple


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
    for item in overrides or ():
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. train.steps=300)")
        key, raw = item.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        node, parts = config, key.split(".")
        for p in parts[:-1]:
            if p not in node:
                raise KeyError(f"override {item!r}: the config has no {p!r} (in {key!r})")
            node = node[p]
        if parts[-1] not in node:
            raise KeyError(f"override {item!r}: the config has no {key!r}; known here: "
                           f"{', '.join(sorted(node.keys()))}")
        old = node[parts[-1]]
        if isinstance(old, float) and isinstance(value, int):
            value = float(value)
        if isinstance(old, tuple) and isinstance(value, (list, str)):
            value = tuple(value) if isinstance(value, list) else (value,)
        try:
            node[parts[-1]] = value
        except TypeError:  # ml_collections keeps a key's type
            raise ValueError(f"override {item!r}: {key} must be of type "
                             f"{type(old).__name__} (like its default, {old!r}), not "
                             f"{value!r}") from None
    return config


def load_config(path: str | Path, overrides=()) -> ml_collections.ConfigDict:
    """``get_config()`` of the config file ``path`` (or a name in experiments/configs/),
    with ``overrides`` applied."""
    path = Path(path)
    if not path.exists() and (CONFIG_DIR / f"{path}.py").exists():
        path = CONFIG_DIR / f"{path}.py"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem[0] != "_"))
        raise FileNotFoundError(f"config {str(path)!r} not found (configs here: {known})")
    module = _load_module(path) if path.suffix == ".py" else None
    if not hasattr(module, "get_config"):
        raise ValueError(f"config {str(path)!r} is not a config file: a .py file with a "
                         "get_config() (as in experiments/configs/)")
    return apply_overrides(module.get_config(), overrides)


# keys (or sections) that do not change what a run computes (a run may resume with other
# values): the compile cache, and the sweep a run belongs to (a sweep sets each run's policy
# and seed in precision.policy and seed, which are part of it)
NOT_PART_OF_THE_RUN = ("compile_cache", "sweep")
# what a run's config.json records of its resolved policy: its rules are compared through
# their hash, precision.policy_sha256 (experiments.run_spec.config_record)
POLICY_HASH, POLICY_RULES = "precision.policy_sha256", "precision.policy_rules"


# The value a run stored before a key existed had, where it is not the key's default in
# default.py. Every other key such a run lacks had its default (the code before the key did
# what the default does now); when a default changes, the key's old value goes here.
BEFORE_THE_KEY = {
    # before data.suffixes (Dec 2026, 785eb73) a data folder gave only its *.py files (and
    # did not yet leave out hidden files and files with a NUL byte)
    "data.suffixes": (".py",),
}


def with_defaults(stored: dict) -> dict:
    """A stored run's config (``config.json``, or any config as a dict) completed with every
    key of ``default.py`` it lacks, at the value such a run had: its default, or
    :data:`BEFORE_THE_KEY`'s. Keys it has keep their stored values, keys the defaults do not
    have (``precision.policy_sha256``, ``sweep``) stay; ``stored`` itself is not changed."""
    from experiments.configs.default import get_config

    then = get_config().to_dict()
    for key, value in BEFORE_THE_KEY.items():
        *sections, name = key.split(".")
        node = then
        for section in sections:
            node = node[section]
        node[name] = value
    return _fill(copy.deepcopy(stored), then)


def _fill(stored: dict, defaults: dict) -> dict:
    for k, v in defaults.items():
        if k not in stored:
            stored[k] = v
        elif isinstance(v, dict) and isinstance(stored[k], dict):
            _fill(stored[k], v)
    return stored


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict, new: dict) -> dict[str, tuple]:
    """``{dotted key: (old value, new value)}`` for every key whose value differs between two
    configs given as dicts (``ConfigDict.to_dict()`` or a stored ``config.json``); values are
    compared as JSON stores them (tuples as lists), missing keys as ``None``. A key ``old``
    lacks is no change where ``new`` has the value a run stored before the key existed had
    (:func:`with_defaults`), and ``(None, new value)`` otherwise. The resolved
    policy's rules are compared through their hash, which is left out when the policy's
    name changed too (the name says it)."""
    import json

    norm = lambda d: _flat(json.loads(json.dumps(d, sort_keys=True, default=float)))  # noqa
    a, b = norm(old), norm(new)
    then = norm(with_defaults(old))
    for k in then.keys() - a.keys():  # a key added since: no change at the value it had
        if b.get(k) == then[k]:
            a[k] = then[k]
    changes = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
               if a.get(k) != b.get(k) and not _outside_the_run(k)}
    if "precision.policy" in changes:
        changes.pop(POLICY_HASH, None)
    return changes


def _outside_the_run(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.")
               for k in (*NOT_PART_OF_THE_RUN, POLICY_RULES))


def format_changes(changes: dict[str, tuple]) -> str:
    """``train.steps: 60 -> 80, precision.policy: 'nemotron3' -> 'nvfp4'``."""
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def describe_keys(config: ml_collections.ConfigDict) -> str:
    """Every overridable key of ``config`` with its default, one per line (for ``--help``)."""
    return "\n".join(f"  {k} = {v!r}" for k, v in _flat(config.to_dict()).items())


def keys_help(config: str | Path = "default") -> str:
    """The ``--help`` epilog of the commands that take ``key=value`` overrides: every key of
    ``config`` (a config file or name) with its value there."""
    return ("config keys (override with key=value) and their defaults in "
            f"configs/default.py:\n{describe_keys(load_config(config))}")
