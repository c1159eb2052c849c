"""Framework integrations: a framework's own configuration turned into a `Case`.

A user imports the module they need (`from sp_harness.cases.frameworks.megatron_core import
megatron_case`); each needs its framework installed (`pip install sp-harness[megatron]`).

Each framework also has a `*_cases` module of built-in cases (a correct configuration, its
mutants through the framework's own knobs, the main job's examples). Those are registered only
where the framework is installed: `FRAMEWORK_CASES` maps the module that must be importable to
the module that registers them. Registering imports no framework code: the framework is
imported in the rank processes that run its cases (`Case.setup`), and its cases share rank
processes only with each other (`Case.isolation` names the framework).
"""

from __future__ import annotations

import importlib
import importlib.util

FRAMEWORK_CASES: dict[str, str] = {
    "megatron.core": "sp_harness.cases.frameworks.megatron_cases",
    "yunchang": "sp_harness.cases.frameworks.yunchang_cases",
    "torchtitan": "sp_harness.cases.frameworks.torchtitan_cases",
    "deepspeed": "sp_harness.cases.frameworks.deepspeed_cases",
}
"""importable framework module -> the module registering its built-in cases."""


def installed(module: str) -> bool:
    """Whether `module` (dotted) can be imported, without importing it (its parent package's
    `__init__` aside)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def register_installed() -> list[str]:
    """Registers the built-in cases of every installed framework; returns their modules."""
    found = [cases for module, cases in FRAMEWORK_CASES.items() if installed(module)]
    for cases in found:
        importlib.import_module(cases)
    return found
