"""Systems under test, registered lazily: importing this package imports no case. `BUILTIN`
names the module that registers each built-in case; the registry (sp_harness.config.registry)
imports a case's module on the first lookup of its name, and every module on `all_cases()`.
A framework's built-in cases are listed only where what they need can be imported
(`FRAMEWORK_CASES`; `unavailable()` names the others and why). A module listed here must register
the names listed for it (tests/test_registry.py); a framework's may register more (those it
cannot run here), which the registry does not count.
"""

from __future__ import annotations

from sp_harness.cases.frameworks import FRAMEWORK_CASES, unavailable

BUILTIN: dict[str, tuple[str, ...]] = {
    "sp_harness.cases.dtensor_mutants": (
        "mutant-dtensor-norm-missing-sp", "mutant-dtensor-norm-init-per-rank", "mutant-dtensor-output-wrong-dim"),
    "sp_harness.cases.dtensor_plans": ("seed-mlp", "dtensor-gpt"),
    "sp_harness.cases.megatron.cases": ("megatron-gpt-ref", "megatron-gpt-tp", "megatron-gpt-sp"),
    "sp_harness.cases.megatron.clip_mutants": ("mutant-sp-clip-norm-counts-replicas",),
    "sp_harness.cases.megatron.collective_mutants": (
        "mutant-sp-reduce-scatter-world", "mutant-tp-all-reduce-world", "mutant-sp-gather-dim0-bsh",
        "mutant-sp-collectives-assume-even", "mutant-sp-gather-wrong-order", "mutant-sp-gather-backward-split"),
    "sp_harness.cases.megatron.memory_mutants": ("mutant-sp-full-sequence-norms",),
    "sp_harness.cases.megatron.mutants": (
        "mutant-sp-no-norm-grad-sync", "mutant-sp-norm-sync-lost-at-step-3", "mutant-sp-norm-grad-sync-dp-group",
        "mutant-sp-no-row-bias-grad-sync", "mutant-sp-no-embedding-grad-sync", "mutant-sp-row-bias-before-reduce",
        "mutant-tp-row-bias-before-reduce", "mutant-sp-local-positions", "mutant-sp-even-shard-positions",
        "mutant-sp-loss-mean-per-rank"),
    "sp_harness.cases.megatron.precision_mutants": ("mutant-sp-positions-bf16",),
    "sp_harness.cases.megatron.scaled_mutants": ("mutant-scaled-forward", "mutant-scaled-grad", "mutant-scaled-update",
                                                "mutant-scaled-norm-grad"),
    "sp_harness.cases.megatron.train_mutants": (
        "mutant-train-mean-of-means", "mutant-train-drop-middle-microbatches", "mutant-train-dp-local-count",
        "mutant-train-clip-missing-param", "mutant-train-norm-avg-shards", "mutant-train-logged-loss-per-rank"),
    "sp_harness.cases.ring.cases": ("ring-gpt",),
    "sp_harness.cases.ring.mutants": (
        "mutant-ring-dkv-not-sent-back", "mutant-ring-mask-ignores-zigzag", "mutant-ring-zigzag-drops-tail",
        "mutant-ring-merge-by-max", "mutant-ring-loss-per-rank-norm", "mutant-ring-balancer-assumes-causal",
        "mutant-ring-zigzag-unbalanced", "mutant-ring-lse-base2"),
    "sp_harness.cases.ring.precision_mutants": ("mutant-ring-positions-bf16",),
    "sp_harness.cases.ring.train_mutants": (
        "mutant-train-cp-local-count", "mutant-train-loss-times-sp", "mutant-train-sp-grads-unsynced",
        "mutant-train-ga-times-sp"),
    "sp_harness.cases.torch_cp.cases": ("torch-cp-gpt", "torch-cp-gpt-math"),
    "sp_harness.cases.ulysses.cases": ("ulysses-gpt",),
    "sp_harness.cases.ulysses.mutants": (
        "mutant-ulysses-a2a-assumes-even", "mutant-ulysses-gqa-kv-heads-tiled", "mutant-ulysses-backward-forward-splits",
        "mutant-ulysses-loss-mean-per-rank", "mutant-ulysses-label-shift-per-shard", "mutant-ulysses-no-sp-grad-sync",
        "mutant-ulysses-local-positions"),
    "sp_harness.cases.ulysses.precision_mutants": ("mutant-ulysses-positions-bf16",),
    "sp_harness.cases.usp.cases": ("usp-gpt",),
    "sp_harness.cases.usp.mutants": (
        "mutant-usp-zigzag-over-sp", "mutant-usp-grad-sync-ring-only", "mutant-usp-ring-low-groups"),
    "sp_harness.cases.usp.precision_mutants": ("mutant-usp-positions-bf16",),
}
"""Module -> the built-in cases it registers. A family's mutants live beside its cases (`mutants.py`,
and `*_mutants.py` by theme); a mutant module imports its twin's (scaled_mutants: sensitivity
probes, tagged 'scaled': not in the battery)."""


def builtin_modules() -> dict[str, str]:
    """Case name -> the module registering it: every built-in case but those `unavailable()` names."""
    missing = unavailable()
    listed = {**BUILTIN, **{module: names for module, names in FRAMEWORK_CASES.values()}}
    return {name: module for module, names in listed.items() for name in names if name not in missing}

