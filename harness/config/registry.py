"""Stage: config. The case registry: built-in cases by name, and `mutant()`, the one way to define
a mutant.

A built-in case registers itself when its module is imported; `BUILTIN` in sp_harness.cases names
that module, so a lookup imports only the module that holds the name. A built-in case that needs
a module that cannot be imported here (sp_harness.cases' `unavailable()`: a framework missing or
broken) is no case of `all_cases()`, and a lookup of it answers a stand-in that is UNSUPPORTED
for that reason, before any rank starts. A user's case is found by `path.py:NAME` and stays out
of the registry. The registry also hands `CheckConfig` its resolver (`RESOLVE`, `CASE_DEFAULTS`):
check_config cannot import the registry back.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from sp_harness.config.case import Case, Unsupported
from sp_harness.config.check_config import CASE_DEFAULTS, ENGINE_DEFAULTS, RESOLVE
from sp_harness.config.loading import load_case_file
from sp_harness.config.step_protocol import TrainLoss


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


_TABLES: tuple[dict[str, str], dict[str, str]] | None = None


def _tables() -> tuple[dict[str, str], dict[str, str]]:
    """(case name -> the module registering it, case name -> why it cannot run here), read by name
    from sp_harness.cases (the engine names no case module), once a process: what can be imported
    does not change under a running check."""
    global _TABLES
    if _TABLES is None:
        cases = importlib.import_module("sp_harness.cases")
        _TABLES = cases.builtin_modules(), cases.unavailable()
    return _TABLES


def _load_builtin(name: str | None = None) -> None:
    """Imports the module registering built-in case `name` (None: every built-in case's)."""
    table = _tables()[0]
    modules = dict.fromkeys(table.values()) if name is None else [table[name]] if name in table else []
    for module in modules:
        importlib.import_module(module)
    missing = sorted(n for n in table if (name is None or n == name) and n not in _REGISTRY)
    if missing:
        raise LookupError(f"sp_harness.cases lists {missing} in {sorted({table[n] for n in missing})}, "
                          f"which registered no such case")


def install_hint(module: str) -> str:
    """How a user installs what provides `module` (dotted): the sp-harness extra of its framework
    (sp_harness.cases' EXTRAS, read by name), else a reinstall of the package."""
    extras: dict[str, str] = importlib.import_module("sp_harness.cases.frameworks").EXTRAS
    for framework, extra in extras.items():
        if module == framework or module.startswith(framework + "."):
            return f"pip install 'sp-harness[{extra}]'"
    return f"reinstall the package that provides {module.partition('.')[0]}"


def all_cases() -> dict[str, Case]:
    """Every registered case that can run here (none of `unavailable_cases()`)."""
    _load_builtin()
    unavailable = _tables()[1]
    return {name: case for name, case in _REGISTRY.items() if name not in unavailable}


def unavailable_cases() -> dict[str, Case]:
    """The built-in cases that cannot run here, as their stand-ins (`get_case`'s)."""
    return {name: _stand_in(name) for name in _tables()[1]}


_STAND_INS: dict[str, Case] = {}


def _stand_in(name: str) -> Case:
    """Built-in case `name`, which cannot run here, as a case that says why: UNSUPPORTED from its
    `validate` (and from anything else it is asked) for every config. It declares a training step
    (`train_loss`) whether its case does or not, so that `--train-step` reaches the same line."""
    if name not in _STAND_INS:
        why = f"case {name} {_tables()[1][name]}"

        def unsupported(*_: Any) -> Any:
            raise Unsupported(why)

        _STAND_INS[name] = Case(
            name=name, description=f"unavailable: {_tables()[1][name]}", build_reference=unsupported,
            make_batch=unsupported, loss_sum=unsupported, tokens=unsupported, shard=unsupported,
            validate=unsupported, train_loss=TrainLoss(), tags=("mutant",) if name.startswith("mutant-") else ())
    return _STAND_INS[name]


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
    if name in _tables()[1]:
        # even where its module registered it (deepspeed_cases registers its HF cases without
        # transformers): its ranks would import what is missing
        return _stand_in(name)
    if name not in _REGISTRY:
        _load_builtin(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown case {name!r}; known cases: {', '.join(sorted(all_cases()))}")
    return _REGISTRY[name]


def _rename(case: Case, name: str) -> Case:
    return dataclasses.replace(case, name=name)


RESOLVE[:] = [lambda config: get_case(config.case).resolve(config)]  # for CheckConfig.repro (no import back)
CASE_DEFAULTS[:] = [lambda name: {**ENGINE_DEFAULTS, **get_case(name).defaults}]  # for CheckConfig.short
