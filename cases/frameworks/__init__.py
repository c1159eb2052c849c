"""Framework integrations: a framework's own configuration turned into a `Case`.

A user imports the module they need (`from sp_harness.cases.frameworks.megatron.case import
megatron_case`); each needs its framework installed (`pip install sp-harness[megatron]`).

Each framework also has a `*_cases` module of built-in cases (a correct configuration, its
mutants through the framework's own knobs, the main job's examples). `FRAMEWORK_CASES` maps the
framework's module to the module that registers them and their names (the registry imports that
module on the first lookup of one of them: sp_harness.cases). Registering imports no framework
code: the framework is imported in the rank processes that run its cases (`Case.setup`), and its
cases share rank processes only with each other (`Case.isolation` names the framework).

A case runs only where every module it needs (`needed`: its framework's, then `ALSO_NEEDED`'s)
can be found; `unavailable()` says why the others cannot, naming the module and the pip extra
(`EXTRAS`) that installs it. The registry leaves them out of `all_cases()` and answers a lookup
of one with a case that is UNSUPPORTED for that reason (sp_harness.config.registry): a framework
missing or broken never stops another case from running, nor a rank from starting.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

HF_SP_CASES = ("hf-trainer-sp-llama", "mutant-hf-trainer-sp-count-divided-by-sp", "mutant-hf-trainer-sp-duplicate-data",
               "mutant-hf-trainer-sp-accumulation-count-times-sp", "release-hf-sp-mean-of-means-times-sp")
"""The HF Trainer's sequence-parallel cases: accelerate's SP backend is DeepSpeed's Ulysses."""

TRL_SP_CASES = ("trl-sft-sp-llama", "mutant-trl-sft-sp-count-divided-by-sp", "release-trl-sft-sp-mean-of-means-times-sp")
"""TRL's SFTTrainer on the same SP path."""

FRAMEWORK_CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "megatron.core": ("sp_harness.cases.frameworks.megatron.cases", (
        "mcore-gpt-tp", "mcore-gpt-sp", "mutant-mcore-norm-flag-dropped", "mutant-mcore-row-bias-flag-dropped",
        "mutant-mcore-ddp-sync-only", "mcore-gpt-sp-step", "mcore-gpt-sp-step-distopt", "mutant-mcore-step-local-token-mean",
        "mutant-mcore-step-clip-norm-tp-rank0", "mcore-llama-sp", "mutant-mcore-llama-final-norm-flag-dropped",
        "mutant-mcore-llama-swiglu-contiguous-split", "mcore-moe-sp", "mutant-mcore-moe-router-counts-over-dp",
        "mcore-gpt-sp-loss", "mutant-mcore-label-smoothing-local-vocab", "mcore-gpt-sp-labels",
        "mutant-mcore-gathered-logits-labels", "mcore-xattn-sp", "mutant-mcore-xattn-global-tp-group",
        "mcore-gpt-cp", "mutant-mcore-cp-kv-not-gathered", "mcore-gpt-cp-step",
        "release-mcore-7452-f9-cp-local-token-count", "mcore-gpt-sp-step-sinks",
        "release-mcore-7452-f8-sinks-clip-norm")),
    "yunchang": ("sp_harness.cases.frameworks.yunchang.cases", (
        "yc-usp", "yc-usp-torch-flash", "mutant-yc-zigzag-contiguous-shards", "mutant-yc-ring-merge-overwrites",
        "mutant-yc-grad-sync-ulysses-only", "mutant-yc-causal-mask-on-received-blocks", "yc-ulysses",
        "mutant-yc-ulysses-a2a-default-indices", "mutant-yc-ring-backward-stale-kv",
        "mutant-yc-groups-across-dp-replicas", "mutant-yc-ring-backward-grad-count")),
    "torchtitan": ("sp_harness.cases.frameworks.torchtitan.cases", (
        "titan-llama3-sp", "mutant-titan-embedding-partial-as-replicate", "mutant-titan-norm-sp-dropped",
        "mutant-titan-fsdp-grads-summed-over-dp", "titan-qwen3-spmd-sp", "mutant-titan-spmd-norm-declared-invariant",
        "mutant-titan-spmd-embedding-partial-as-replicate", "titan-llama3-sp-step",
        "mutant-titan-step-per-micro-batch-mean", "mutant-titan-step-fsdp-divides-twice",
        "mutant-titan-step-clip-norm-local-shard", "titan-llama3-cp", "mutant-titan-cp-positions-not-sharded",
        "titan-llama3-sp-loss", "mutant-titan-loss-counts-masked-tokens", "mutant-titan-cp-fsdp-grads-summed-over-dp")),
    "deepspeed": ("sp_harness.cases.frameworks.deepspeed.cases", (
        "ds-ulysses", "ds-ulysses-f64", "ds-ulysses-hf-llama", "mutant-ds-ulysses-detached-a2a",
        "mutant-ds-ulysses-batch-dim-idx", "mutant-ds-ulysses-scatter-gather-swapped",
        "mutant-ds-ulysses-engine-without-sp-group", "ds-ulysses-step", "ds-ulysses-step-zero1", "ds-ulysses-step-zero2",
        "ds-ulysses-step-zero3", "ds-ulysses-step-offload", "ds-ulysses-step-offload-multi-backward",
        "mutant-ds-step-offload-drops-middle", "mutant-ds-step-offload-multi-backward-keeps-last",
        "mutant-ds-step-loss-scaled-by-gas-twice", "ds-ulysses-uneven-heads", "ds-ulysses-zero2", "ds-ulysses-hf-qwen2",
        "mutant-ds-ulysses-uneven-heads-without-mpu", "mutant-ds-ulysses-hf-local-position-ids",
        "mutant-ds-ulysses-stale-kv-heads", "ds-ulysses-token-loss", "mutant-ds-ulysses-loss-per-shard-mean",
        "mutant-ds-ulysses-hf-exchange-detached", "release-ds-7967-offload-ga3-drops-middle",
        "release-ds-7981-offload-multi-backward-keeps-last", "release-ds-8317-seq-first-output-layout",
        "release-ds-6774-output-a2a-uneven-path", "release-ds-7649-stage0-clip-slim-mpu",
        "release-ds-7509-zero2-ga-accumulator",
        "release-ds-7837-stage0-bf16-loss-scale", "release-ds-stage0-bf16-adamw-init-step")),
    "accelerate": ("sp_harness.cases.frameworks.hf.cases", (
        "hf-trainer-llama", "hf-trainer-qwen2", "hf-trainer-llama-user-loss",
        "mutant-hf-trainer-mean-of-micro-batch-means", "mutant-hf-trainer-4470-training-step",
        "hf-trainer-llama-label-smoothing", "mutant-hf-trainer-label-smoother-per-micro-batch",
        "release-hf-34191-mean-of-micro-batch-means", "release-hf-35207-loss-times-k-and-ranks",
        "release-hf-46731-label-smoother-per-micro-batch", "release-hf-5x-grads-divided-by-k-twice", *HF_SP_CASES)),
    "trl": ("sp_harness.cases.frameworks.trl.cases", ("trl-sft-llama", "mutant-trl-sft-prompt-trained", *TRL_SP_CASES)),
    "verl": ("sp_harness.cases.frameworks.verl.cases", (
        "verl-sft-sp-llama", "mutant-verl-sp-grads-not-synced-over-sp", "mutant-verl-sp-dp-size-as-world-size",
        "mutant-verl-sp-ranks-see-different-sequences")),
}
"""importable framework module -> (the module registering its built-in cases, their names)."""

EXTRAS: dict[str, str] = {"megatron.core": "megatron", "yunchang": "yunchang", "torchtitan": "torchtitan",
                          "deepspeed": "deepspeed", "accelerate": "hf", "trl": "trl",
                          "verl": "verl"}
"""framework module -> the pip extra of sp-harness (pyproject.toml) that installs it and every module
its cases need."""

COMPAT: dict[str, str] = {
    "megatron.core": "sp_harness.cases.frameworks.megatron.compat", "yunchang": "sp_harness.cases.frameworks.yunchang.compat",
    "torchtitan": "sp_harness.cases.frameworks.torchtitan.compat", "deepspeed": "sp_harness.cases.frameworks.deepspeed.compat",
    "accelerate": "sp_harness.cases.frameworks.hf.compat", "trl": "sp_harness.cases.frameworks.trl.compat",
    "verl": "sp_harness.cases.frameworks.verl.compat",
}
"""framework module -> its package's `compat` module: the supported releases (`RELEASES`) and the
APIs the installed one lacks (`missing()`), sp_harness.cases.frameworks.releases."""

ALSO_NEEDED: dict[str, tuple[str, ...]] = {
    # torchtitan's models and its spmd_types backend's sharded twins import it themselves
    "spmd_types": FRAMEWORK_CASES["torchtitan"][1],
    # UlyssesSPAttentionHF runs on transformers' models; the Trainer is transformers' own
    "transformers": ("ds-ulysses-hf-llama", "ds-ulysses-hf-qwen2", "mutant-ds-ulysses-hf-local-position-ids",
                     "mutant-ds-ulysses-hf-exchange-detached", *FRAMEWORK_CASES["accelerate"][1],
                     *FRAMEWORK_CASES["trl"][1], *FRAMEWORK_CASES["verl"][1]),
    # the SFTTrainer runs in the Trainer's loop, over accelerate
    "accelerate": FRAMEWORK_CASES["trl"][1],
    "deepspeed": (*HF_SP_CASES, *TRL_SP_CASES),
    # verl's engine nests its batches in tensordict and imports ray (verl.protocol)
    "tensordict": FRAMEWORK_CASES["verl"][1],
    "ray": FRAMEWORK_CASES["verl"][1],
}
"""module -> the framework cases that need it besides their framework's own module."""


def import_problem(module: str) -> str | None:
    """None where `module` (dotted) can be found, without importing it (its parent packages are
    imported); else what stops it, worded to follow "needs MODULE, ": it is not installed, or
    finding it raised (a parent package's `__init__` or an import hook: any exception)."""
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            return f"whose import fails ({type(exc).__name__}: {exc})"  # a module it imports is missing
    except Exception as exc:  # a broken install raises whatever it raises
        return f"whose import fails ({type(exc).__name__}: {exc})"
    return "which is not installed"


def installed(module: str) -> bool:
    """Whether `module` (dotted) can be imported, without importing it (its parent package's
    `__init__` aside)."""
    return import_problem(module) is None


def needed(framework: str, name: str) -> tuple[str, ...]:
    """The modules framework case `name` (of `framework`'s cases) needs, its framework's first."""
    return (framework, *(module for module, names in ALSO_NEEDED.items() if name in names))


def out_of_range(framework: str) -> str | None:
    """None where `framework`'s installed releases are in its package's supported range; else why,
    worded to follow "needs " (read from the distributions' metadata: nothing is imported)."""
    from sp_harness.cases.frameworks.releases import outside

    return outside(importlib.import_module(COMPAT[framework]).RELEASES)


def unavailable() -> dict[str, str]:
    """Framework case name -> why it cannot run here, worded to follow "case NAME ": the first
    module it needs that cannot be imported, and the extra that installs it; or its framework's
    installed release outside the supported range. Each module is asked once."""
    problems: dict[str, str | None] = {}  # module -> why it cannot be imported
    ranges: dict[str, str | None] = {}  # framework module -> why its releases are out of range
    why = {}
    for framework, (_, names) in FRAMEWORK_CASES.items():
        hint = f"pip install 'sp-harness[{EXTRAS[framework]}]'"
        for name in names:
            for module in needed(framework, name):
                if module not in problems:
                    problems[module] = import_problem(module)
                if problems[module] is not None:
                    why[name] = f"needs {module}, {problems[module]} ({hint})"
                    break
                if module in COMPAT:
                    if module not in ranges:
                        ranges[module] = out_of_range(module)
                    if ranges[module] is not None:
                        why[name] = f"needs {ranges[module]} ({hint} installs the tested releases)"
                        break
    return why


@dataclass(kw_only=True, frozen=True)
class InstalledFramework:
    """One framework as `sp-harness env` shows it."""

    framework: str
    """Its importable module (sp_harness.cases.frameworks' keys): 'megatron.core', 'accelerate', ..."""
    package: str
    """Its integration's package here: 'megatron', 'hf', ... (sp_harness.cases.frameworks.<package>)."""
    releases: tuple[tuple[str, str | None, str], ...]
    """(distribution, the installed release or None, the supported range) for each it runs on."""
    verdict: str
    """'ok' (in range, every API there), 'in range' (APIs not asked), 'not installed', or why its
    cases are UNSUPPORTED here (out of range, an API missing)."""


def installed_frameworks(*, probe_apis: bool = True) -> list[InstalledFramework]:
    """Each framework integration, its installed releases and whether its cases can run on them;
    `probe_apis` also asks `missing()` of each one installed and in range (one child import each)."""
    from sp_harness.cases.frameworks.releases import installed_release, outside, probe

    rows = []
    for framework, compat_module in COMPAT.items():
        ranges = importlib.import_module(compat_module).RELEASES
        found = tuple((r.distribution, installed_release(r.distribution), f"{r.oldest} to {r.newest}") for r in ranges)
        problem = import_problem(framework)
        if problem is not None:
            verdict = "not installed" if problem == "which is not installed" else f"broken: {problem}"
        elif (reason := outside(ranges)) is not None:
            verdict = f"out of range: needs {reason}"
        elif probe_apis and (gaps := probe(compat_module)):
            verdict = f"missing: {'; '.join(gaps)}"
        else:
            verdict = "ok" if probe_apis else "in range"
        rows.append(InstalledFramework(framework=framework, package=compat_module.split(".")[-2], releases=found,
                                       verdict=verdict))
    return rows
