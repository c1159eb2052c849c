"""Stage: config. The case registry: built-in cases by name, and `mutant()`, the one way to define
a mutant.

A built-in case registers itself when its module is imported; `BUILTIN` in sp_harness.cases names
that module, so a lookup imports only the module that holds the name. A user's case is found by
`path.py:NAME` and stays out of the registry. The registry also hands `CheckConfig` its resolver
(`RESOLVE`, `CASE_DEFAULTS`): check_config cannot import the registry back.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from sp_harness.config.case import Case
from sp_harness.config.check_config import CASE_DEFAULTS, ENGINE_DEFAULTS, RESOLVE
from sp_harness.config.loading import load_case_file


def mutant(base: Case, *, name: str, summary: str, bug: str, source: str, tags: tuple[str, ...] = (),
           killed_by: tuple[str, ...] = (), **changes: Any) -> Case:
    """The one way to define a mutant: `base` (its correct twin) with `changes` (Case fields, usually
    `shard`), the bug it models and its public source. Registered under `name` where its twin is
    registered (a built-in case); a mutant in a user's case file is found by `path:NAME`, like
    its twin, and stays out of the registry (the battery's catalogue, the nightly examples).
    `killed_by`: its pin (`Case.killed_by`), which a registered mutant must declare."""
    if not name.startswith("mutant-"):
        raise ValueError(f"mutant names start with 'mutant-', got {name!r}")
    if not bug or not source:
        raise ValueError(f"mutant {name} needs the bug it models and its public source")
    all_tags = tuple(dict.fromkeys(base.tags + ("mutant",) + tags))
    if "shard" in changes and "train_loss" not in changes:
        # a new sharded factory does not carry the twin's training step: a mutant that keeps one
        # passes the twin's train_loss with it
        changes["train_loss"] = None
    made = dataclasses.replace(
        base, name=name, description=f"MUTANT {base.name}: {summary}", models_bug=bug, source=source,
        twin=base.name, tags=all_tags, expect=None, examples=(), killed_by=killed_by, **changes)
    return register(made) if _REGISTRY.get(base.name) is base else made


_REGISTRY: dict[str, Case] = {}


def register(case: Case) -> Case:
    if case.name in _REGISTRY and _REGISTRY[case.name] is not case:
        raise ValueError(f"case {case.name!r} is registered twice")
    _REGISTRY[case.name] = case
    return case


def _load_builtin(name: str | None = None) -> None:
    """Imports the module registering built-in case `name` (None: every built-in case's), by the
    table in sp_harness.cases, read by name: the engine names no case module."""
    table: dict[str, str] = importlib.import_module("sp_harness.cases").builtin_modules()
    modules = dict.fromkeys(table.values()) if name is None else [table[name]] if name in table else []
    for module in modules:
        importlib.import_module(module)
    missing = sorted(n for n in table if (name is None or n == name) and n not in _REGISTRY)
    if missing:
        raise LookupError(f"sp_harness.cases lists {missing} in {sorted({table[n] for n in missing})}, "
                          f"which registered no such case")


def all_cases() -> dict[str, Case]:
    _load_builtin()
    return dict(_REGISTRY)


def get_case(name: str) -> Case:
    """A registered case by name, or `path/to/file.py:NAME` for a case in a user's file."""
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        path, attr = name.split(":", 1)
        module = load_case_file(path)
        case = getattr(module, attr, None)
        if not isinstance(case, Case):
            found = sorted(k for k, v in vars(module).items() if isinstance(v, Case))
            raise ValueError(f"{path} has no Case named {attr!r}; Cases there: {found}")
        # keep the user's name (path:NAME) so ranks can load it the same way
        return case if case.name == name else _rename(case, name)
    if name not in _REGISTRY:
        _load_builtin(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown case {name!r}; known cases: {', '.join(sorted(all_cases()))}")
    return _REGISTRY[name]


def _rename(case: Case, name: str) -> Case:
    return dataclasses.replace(case, name=name)


RESOLVE[:] = [lambda config: get_case(config.case).resolve(config)]  # for CheckConfig.repro (no import back)
CASE_DEFAULTS[:] = [lambda name: {**ENGINE_DEFAULTS, **get_case(name).defaults}]  # for CheckConfig.short
