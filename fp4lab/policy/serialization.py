"""Policies as JSON: written atomically, read with every key checked."""

from __future__ import annotations

import contextlib
import dataclasses

from fp4lab.policy.rules import DEFAULT_BLOCK_PATTERN, Depth, PrecisionPolicy, Rule
from fp4lab.gemm.recipe import Recipe, get_recipe

__all__ = ["policy_to_dict", "policy_from_dict", "load_policy", "save_policy"]


def load_policy(path) -> PrecisionPolicy:
    """The policy in a JSON file written by :func:`save_policy` (or
    ``experiments.auto_assign``); every key is checked (:func:`policy_from_dict`), and an
    error names the file."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy file {str(path)!r} " + (
            "is a folder, not a file" if path.is_dir() else "does not exist"))
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"policy file {str(path)!r} is not JSON: {e}") from None
    try:
        return policy_from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy file {str(path)!r}: {e}") from None


def save_policy(policy: PrecisionPolicy, path) -> None:
    """Write ``policy`` as JSON (atomically: a reader sees the old file or the new one)."""
    import json

    from fp4lab.files import write_atomic

    write_atomic(path, json.dumps(policy_to_dict(policy), indent=1) + "\n")


def policy_to_dict(policy: PrecisionPolicy) -> dict:
    """A JSON-able description of ``policy`` (recipes by registry name)."""
    from fp4lab.gemm.recipe import RECIPES

    def recipe_name(r: Recipe) -> str:
        if RECIPES.get(r.name) != r:
            raise ValueError(f"recipe {r.name!r} is not the registry's; only registered "
                             "recipes can be serialized")
        return r.name

    return {"name": policy.name, "default": recipe_name(policy.default),
            "block_pattern": policy.block_pattern,
            "rules": [{"recipe": recipe_name(r.recipe), "pattern": r.pattern, "kind": r.kind,
                       "name": r.name, "outside_blocks": r.outside_blocks,
                       "required": r.required,
                       "depth": dataclasses.asdict(r.depth) if r.depth else None}
                      for r in policy.rules]}


# the keys of a policy file, of each rule and of a rule's depth: name -> (accepted types,
# required). Anything else is an error naming the key: a misspelt "pattern" would otherwise
# leave a rule that matches every layer, a misspelt "default" a BF16 default.
_POLICY_KEYS = {"rules": (list, False), "default": (str, True), "block_pattern": (str, False),
                "name": (str, False)}
_RULE_KEYS = {"recipe": (str, True), "pattern": (str, False), "kind": ((str, type(None)), False),
              "name": (str, False), "outside_blocks": (bool, False), "required": (bool, False),
              "depth": ((dict, type(None)), False)}
_DEPTH_KEYS = {f.name: ((int, float) if "fraction" in f.name else int, False)
               for f in dataclasses.fields(Depth)}


def _checked(d, keys: dict, where: str) -> dict:
    """``d`` (a JSON object) after checking its keys and the types of their values against
    ``keys``; the error names ``where``, the key and the known keys."""
    if not isinstance(d, dict):
        raise TypeError(f"{where} must be a JSON object, not {type(d).__name__} ({d!r:.60})")
    unknown = [k for k in d if k not in keys]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(keys)}")
    missing = [k for k, (_, required) in keys.items() if required and k not in d]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    for k, v in d.items():
        types = keys[k][0]
        # bool is an int in Python: a depth of `true` blocks must not pass as 1
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in (
                types if isinstance(types, tuple) else (types,))):
            raise TypeError(f"{where}: {k}={v!r} must be {_type_names(types)}")
    return d


def _type_names(types) -> str:
    names = {"str": "a string", "list": "a list", "bool": "true or false", "int": "an integer",
             "float": "a number", "dict": "an object", "NoneType": "null"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names[t.__name__] for t in types)


def policy_from_dict(d: dict) -> PrecisionPolicy:
    """The inverse of :func:`policy_to_dict`. Every key is checked, at every level: an
    unknown or misspelt key, a missing ``default`` or ``recipe``, or a value of the wrong type
    is an error naming it (never a silently different policy)."""
    _checked(d, _POLICY_KEYS, "policy")
    rules = []
    for i, r in enumerate(d.get("rules", ())):
        where = f"policy rule {i}"
        r = _checked(r, _RULE_KEYS, where)
        depth = r.get("depth")
        with _located(where):
            if depth is not None:
                depth = Depth(**_checked(depth, _DEPTH_KEYS, f"{where} depth"))
            rules.append(Rule(**{**r, "depth": depth}))
    with _located("policy: default"):
        default = get_recipe(d["default"])
    with _located("policy"):
        return PrecisionPolicy(rules=tuple(rules), default=default,
                               block_pattern=d.get("block_pattern", DEFAULT_BLOCK_PATTERN),
                               name=d.get("name", "custom"))


@contextlib.contextmanager
def _located(where: str):
    """Prefix ``where`` to a ValueError raised inside (once: inner errors already say it)."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from None
