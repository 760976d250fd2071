"""Policies by name: the one parser of policy strings (:func:`get_policy`) and the registry
of names and families."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
from collections.abc import Callable, Mapping

from fp4lab.policy.presets import MOE_PRESETS, all_layers, moe_preset, nemotron3, nvfp4_paper
from fp4lab.policy.rules import PrecisionPolicy
from fp4lab.policy.serialization import load_policy
from fp4lab.gemm.recipe import Recipe

__all__ = ["get_policy", "register_policy", "register_policy_family", "known_policies",
           "PRESETS", "scoped_registry"]

# ----------------------------------------------------------------------------- the policy names
#
# One parser (get_policy) and one registry of names. A fixed name maps to a factory that takes
# no arguments; a family is a regex fullmatched on the name plus a factory of the match (for
# parameterised names such as experiments' <recipe>_bf16_last<k>). The library's presets are
# registered below; experiments/ registers its own names when ``experiments`` is imported.

_NAMES: dict[str, Callable[[], PrecisionPolicy]] = {}
_FAMILIES: dict[str, tuple[re.Pattern, Callable[[re.Match], PrecisionPolicy | None], str]] = {}

# the registered fixed names and their factories (read-only: add with register_policy)
PRESETS: Mapping[str, Callable[[], PrecisionPolicy]] = types.MappingProxyType(_NAMES)


def register_policy(name: str, factory: Callable[[], PrecisionPolicy]) -> None:
    """Make ``get_policy(name)`` return ``factory()``, renamed ``name``.

    ``name`` must not hold ``:`` (``all:`` and ``file:`` are prefixes) nor be a recipe's name
    (a recipe name means every layer in that recipe). Registering a name again with the same
    factory does nothing; with a different factory it is an error (two meanings for one
    name)."""
    from fp4lab.gemm.recipe import RECIPES

    if not isinstance(name, str) or not name or name != name.strip() or ":" in name:
        raise ValueError(f"policy name {name!r} must be a non-empty string without ':' or "
                         "surrounding spaces")
    if name in RECIPES:
        raise ValueError(f"policy name {name!r} is a recipe's name, which already means "
                         "every layer in that recipe")
    if not callable(factory):
        raise TypeError(f"the factory of policy {name!r} must be callable, not "
                        f"{type(factory).__name__}")
    if _NAMES.get(name, factory) is not factory:
        raise ValueError(f"policy {name!r} is already registered (factory "
                         f"{_describe(_NAMES[name])}); a second factory "
                         f"({_describe(factory)}) would give one name two meanings")
    _NAMES[name] = factory


def register_policy_family(pattern: str, factory: Callable[[re.Match], PrecisionPolicy | None],
                           *, label: str) -> None:
    """Make every name that ``pattern`` fullmatches a policy: ``get_policy(name)`` returns
    ``factory(match)``, renamed ``name``; a factory returning ``None`` says the match names no
    policy (an unknown recipe, ``k=0``), and the name stays unknown. ``label`` shows the
    family in the list of known policies (``"<recipe>_bf16_last<k>"``).

    Fixed names (:func:`register_policy`), recipe names and the ``all:``/``file:`` prefixes
    come first; families are tried in the order they were registered. Registering a pattern
    again with the same factory does nothing; with a different factory it is an error."""
    try:
        compiled = re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"policy family pattern {pattern!r} is not a valid regex: {e}") from None
    if not callable(factory):
        raise TypeError(f"the factory of policy family {label!r} must be callable, not "
                        f"{type(factory).__name__}")
    if pattern in _FAMILIES and _FAMILIES[pattern][1] is not factory:
        raise ValueError(f"policy family {pattern!r} ({_FAMILIES[pattern][2]}) is already "
                         f"registered with another factory ({_describe(_FAMILIES[pattern][1])})")
    _FAMILIES[pattern] = (compiled, factory, label)


def _describe(factory) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def known_policies() -> str:
    """What :func:`get_policy` accepts, as one line (for error messages and help texts)."""
    from fp4lab.gemm.recipe import RECIPES

    parts = [f"names {', '.join(_NAMES)}"] if _NAMES else []
    if _FAMILIES:
        parts.append(f"families {', '.join(label for _, _, label in _FAMILIES.values())}")
    parts += [f"a recipe for every layer ({', '.join(RECIPES)}) or all:<recipe>",
              "file:<policy.json>", "a PrecisionPolicy or Recipe"]
    return "; ".join(parts)


def get_policy(name: str | PrecisionPolicy | Recipe) -> PrecisionPolicy:
    """The one parser of policies; in this order:

    * a :class:`PrecisionPolicy`: itself;
    * a :class:`Recipe`, a recipe's name (``"nvfp4"``) or ``all:<recipe>``: every layer in
      that recipe (:func:`all_layers`);
    * ``file:<path.json>``: the policy in that file (:func:`load_policy`; what
      ``experiments.auto_assign`` and :func:`save_policy` write);
    * a registered name (:func:`register_policy`: the presets ``nemotron3`` and
      ``nvfp4_paper``; ``import experiments`` adds the experiments' names), then a name of a
      registered family (:func:`register_policy_family`: ``import experiments`` adds
      ``<recipe>_bf16_first<k>`` / ``_last<k>``); the policy carries the name it was asked by.

    Anything else is a ``ValueError`` that lists what is known."""
    from fp4lab.gemm.recipe import RECIPES

    if isinstance(name, PrecisionPolicy):
        return name
    if isinstance(name, Recipe):
        return all_layers(name)
    if isinstance(name, str):
        if name.startswith("all:"):
            return all_layers(name[4:])
        if name.startswith("file:"):
            return load_policy(name[5:])
        if name in _NAMES:
            return _named(_NAMES[name](), name)
        if name in RECIPES:
            return all_layers(name)
        for compiled, factory, _ in _FAMILIES.values():
            m = compiled.fullmatch(name)
            policy = factory(m) if m else None
            if policy is not None:
                return _named(policy, name)
    raise ValueError(f"unknown policy {name!r}; known: {known_policies()}")


def _named(policy, name: str) -> PrecisionPolicy:
    if not isinstance(policy, PrecisionPolicy):
        raise TypeError(f"the factory of policy {name!r} returned {type(policy).__name__}, "
                        "not a PrecisionPolicy")
    return policy if policy.name == name else dataclasses.replace(policy, name=name)


register_policy("nemotron3", nemotron3)
register_policy("nvfp4_paper", nvfp4_paper)


def _moe_factory(name: str) -> Callable[[], PrecisionPolicy]:
    def factory() -> PrecisionPolicy:
        return moe_preset(name)

    factory.__module__, factory.__qualname__ = moe_preset.__module__, f"moe_preset({name!r})"
    return factory


for _name in MOE_PRESETS:
    register_policy(_name, _moe_factory(_name))


@contextlib.contextmanager
def scoped_registry():
    """The registry of names and families as it is now, restored when the block ends: the
    names a test or a notebook registers inside it are forgotten."""
    names, families = dict(_NAMES), dict(_FAMILIES)
    try:
        yield
    finally:
        _NAMES.clear()
        _NAMES.update(names)
        _FAMILIES.clear()
        _FAMILIES.update(families)
