"""The framework integrations' import surface is stable (issue 62): every name the README, the
docs and the examples import, or name by its dotted path, can be imported; and every import path
the docs offered before the integrations moved into one package per framework still works
(`OFFERED`: the old paths keep re-exports). None of this imports a framework."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OFFERED = {
    # the documented imports at 848d93c, before cases/frameworks/<name>/ (examples, README, docs)
    "sp_harness.cases.frameworks.megatron_core": ("megatron_case", "megatron_shard", "drop_sequence_parallel_flag"),
    "sp_harness.cases.frameworks.megatron_module": ("cross_attention", "megatron_module_case"),
    "sp_harness.cases.frameworks.megatron_step": ("MegatronStepConfig", "megatron_train_case"),
    "sp_harness.cases.frameworks.deepspeed_ulysses": ("detached", "ulysses_case",
                                                      # here until ab3262d moved it to deepspeed_hf
                                                      "CausalLMLogits"),
    "sp_harness.cases.frameworks.deepspeed_hf": ("hf_ulysses_case", "CausalLMLogits"),
    "sp_harness.cases.frameworks.deepspeed_module": ("ulysses_module_case",),
    "sp_harness.cases.frameworks.deepspeed_step": ("DeepSpeedStepConfig", "ds_step_case", "ds_step_shard"),
    "sp_harness.cases.frameworks.hf_trainer": ("HFTrainerSetup", "hf_trainer_case"),
    "sp_harness.cases.frameworks.token_loss": ("TokenLoss",),
    "sp_harness.cases.frameworks.torchtitan": ("torchtitan_case", "torchtitan_shard"),
    "sp_harness.cases.frameworks.torchtitan_cases": ("embedding_partial_declared_replicate",),
    "sp_harness.cases.frameworks.torchtitan_step": ("TitanStepConfig", "titan_step_shard", "titan_train_case"),
    "sp_harness.cases.frameworks.yunchang": ("ulysses_case", "usp_case", "yunchang_shard"),
}


def _documents() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md") if "history" not in p.parts]
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").glob("*.py"))]


def _documented_imports() -> set[tuple[str, str]]:
    found = set()
    for path in _documents():
        for module, names in re.findall(r"from (sp_harness[\w.]*) import ([\w, ]+)", path.read_text()):
            found |= {(module, n.split(" as ")[0].strip()) for n in names.split(",") if n.strip()}
    return found


def _dotted_names() -> set[str]:
    """Every `sp_harness.a.b` the documents name in backticks or code: a module or an attribute."""
    found = set()
    for path in _documents():
        found |= set(re.findall(r"(?<![\w./])(sp_harness(?:\.\w+)+)", path.read_text()))
    return found


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not exc.name.startswith("sp_harness"):
                raise  # a framework's import: the surface must not need one
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("module,name", sorted(_documented_imports()))
def test_every_documented_import_works(module, name):
    assert _resolve(f"{module}.{name}") is not None


def test_every_dotted_name_in_the_docs_resolves():
    broken = []
    for dotted in sorted(_dotted_names()):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{dotted}: {type(exc).__name__}: {exc}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("module", sorted(OFFERED))
def test_every_path_offered_before_the_move_still_imports(module):
    imported = importlib.import_module(module)
    assert [n for n in OFFERED[module] if not hasattr(imported, n)] == []


def test_the_moved_names_are_the_same_objects():
    """A re-export, not a copy: a user's case built from the old path is the integration's own."""
    from sp_harness.cases.frameworks import deepspeed, deepspeed_ulysses, megatron, megatron_core

    assert megatron_core.megatron_case is megatron.megatron_case
    assert deepspeed_ulysses.CausalLMLogits is deepspeed.CausalLMLogits
