"""The two invariance checks (accumulation-invariance, degree-invariance) over the frameworks' own
training steps: megatron-core's schedule (CP and attention sinks too), DeepSpeed's engine (ZeRO
0-3, CPU offload), torchtitan's trainer step, the HF Trainer and TRL's SFTTrainer (DDP and
accelerate's SP) and verl's Ulysses SFT step. A correct step PASSes both where they apply; where
one cannot apply the check says n/a with the reason (DeepSpeed fixes its micro-batch count at
initialize, a case built for one TP degree cannot run on one rank), never FAIL, and a step that
crashes only in the check's own one-rank twin is an ERROR of the twin; each framework mutant FAILs
exactly the invariance its bug class breaks (docs/case-api.md: accumulation sees per-micro-batch
normalisation and local counts, degree sees local counts and degree factors, neither sees a
clip-norm bug or a bug every degree shares). The engine's own steps' pins are in
tests/test_train_step.py."""

import importlib.util
import os
import pathlib

import pytest

from sp_harness.cases.frameworks import FRAMEWORK_CASES
from sp_harness.checks import get_check, run_check
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case

ROOT = pathlib.Path(__file__).resolve().parent.parent
MEGATRON_EXAMPLE = os.path.join(ROOT, "examples", "megatron_train_step.py")
TIMEOUT_S = 180.0
"""Generous for a loaded runner: a framework's import is its case's setup, outside the job."""
CHECKS = ("accumulation-invariance", "degree-invariance")


def _installed(module: str) -> bool:
    """Found without importing it: an xdist worker never imports megatron-core (tests/installed.py)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _needs(module: str) -> None:
    if not _installed(module):
        pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]')")


def _framework(case: str) -> str:
    return next(module for module, (_, names) in FRAMEWORK_CASES.items() if case in names)


def _invariances(sp_pool, case: str, checks=CHECKS, **fields):
    """The invariance checks on `case`'s own step: K = 3 uneven micro-batches, float32 (every
    framework step's dtype), SGD with clipping active, as the training-step check runs them."""
    _needs(_framework(case))
    fields = {"micro_batches": 3, "dtype": "float32", "optimizer": "sgd", "clip_grad_norm": 0.01, **fields}
    config = CheckConfig(case=case, train_step=True, timeout_s=TIMEOUT_S, **fields)
    return {name: run_check(get_check(name), config, sp_pool) for name in checks}


def _statuses(outcomes) -> list[str]:
    return [outcomes[name].status for name in CHECKS]


def _details(outcomes) -> str:
    return "; ".join(f"{name}: {o.status} {o.detail}" for name, o in outcomes.items())


ACCUMULATION = ("accumulation-invariance",)


def test_the_hf_trainers_one_batch_reports_the_k_micro_batches_loss(sp_pool):
    # the config: the Trainer's loop sums each micro-batch's loss into its running tr_loss,
    # which only the step's log resets; the one-batch run after K reported both sums
    outcome = _invariances(sp_pool, "hf-trainer-llama", ACCUMULATION, world_size=2, dp=2)["accumulation-invariance"]
    assert outcome.status == "pass", outcome.detail
    loss = outcome.figures.differences[0]
    assert loss.what == "reported loss" and loss.ok, loss.describe()


def test_the_hf_trainers_mean_of_micro_batch_means_still_fails_at_the_reported_loss(sp_pool):
    # dropping the first accumulation's loss and grads must not drop what the check exists to see
    outcome = _invariances(sp_pool, "mutant-hf-trainer-mean-of-micro-batch-means", ACCUMULATION, world_size=2,
                           dp=2)["accumulation-invariance"]
    assert outcome.status == "fail" and outcome.detail.startswith("reported loss"), outcome.detail


def test_megatrons_step_runs_on_one_rank_for_degree_invariance(sp_pool):
    # megatron-core refuses sequence_parallel at TP 1; Megatron-LM's arguments turn it off there,
    # so the one-rank run is the same training run, not a crash in shard()
    outcome = _invariances(sp_pool, "mcore-gpt-sp-step", ("degree-invariance",), world_size=2)["degree-invariance"]
    assert outcome.status == "pass", outcome.detail


def test_an_invariance_that_cannot_apply_says_why_before_any_rank_runs():
    for name, fields, why in [
        ("accumulation-invariance", dict(world_size=2, micro_batches=1), "micro_batches(1) < 2"),
        ("degree-invariance", dict(world_size=1, micro_batches=3), "world_size 1"),
    ]:
        config = CheckConfig(case="megatron-gpt-sp", train_step=True, **fields)
        assert why in (get_check(name).applies(get_case("megatron-gpt-sp"), config) or ""), (name, fields)


def test_a_step_built_for_one_tp_degree_is_not_compared_with_one_rank(sp_pool):
    # the example's step is megatron at TP 2 only: its one-rank twin is UNSUPPORTED, so n/a, with why
    _needs("megatron.core")
    config = CheckConfig(case=f"{MEGATRON_EXAMPLE}:GPT_SP_STEP", train_step=True, world_size=2, micro_batches=3,
                         dtype="float32", optimizer="sgd", timeout_s=TIMEOUT_S)
    outcome = run_check(get_check("degree-invariance"), config, sp_pool)
    assert outcome.status == "n/a" and "one rank" in outcome.detail and "TP 2" in outcome.detail, outcome.detail


FIXED_K = "fixed_micro_batches"
"""What DeepSpeed's n/a names: its engine's gradient_accumulation_steps, fixed at initialize."""
SWEEP = {
    # case: (world_size, dp, optimizer, accumulation-invariance, degree-invariance)
    "mcore-gpt-sp-step": (4, 2, "sgd", "pass", "pass"),
    "mcore-gpt-sp-step-distopt": (4, 2, "adamw", "pass", "pass"),  # its DistributedOptimizer is Adam only
    # local counts: each micro-batch and replica normalised by its own tokens
    "mutant-mcore-step-local-token-mean": (4, 2, "sgd", "fail", "fail"),
    "mutant-mcore-step-clip-norm-tp-rank0": (4, 2, "sgd", "pass", "pass"),  # a clip-norm bug
    "titan-llama3-sp-step": (4, 2, "sgd", "pass", "pass"),
    # per-micro-batch means, and FSDP's average over replicas of their own means
    "mutant-titan-step-per-micro-batch-mean": (4, 2, "sgd", "fail", "fail"),
    "mutant-titan-step-fsdp-divides-twice": (4, 2, "sgd", "pass", "fail"),  # grads / DP
    "mutant-titan-step-clip-norm-local-shard": (4, 2, "sgd", "pass", "pass"),  # a clip-norm bug
    "ds-ulysses-step": (4, 2, "sgd", "n/a", "pass"),
    "ds-ulysses-step-zero1": (4, 2, "sgd", "n/a", "pass"),
    "ds-ulysses-step-zero2": (4, 2, "sgd", "n/a", "pass"),
    "ds-ulysses-step-zero3": (4, 2, "sgd", "n/a", "pass"),
    "ds-ulysses-step-offload": (4, 2, "sgd", "n/a", "pass"),
    "ds-ulysses-step-offload-multi-backward": (4, 2, "sgd", "n/a", "pass"),
    # DeepSpeed's three bugs are the same at every degree (a dropped or a last-only accumulation, a
    # 1/K factor): only accumulation could see them, which its fixed K rules out
    "mutant-ds-step-offload-drops-middle": (4, 2, "sgd", "n/a", "pass"),
    "mutant-ds-step-offload-multi-backward-keeps-last": (4, 2, "sgd", "n/a", "pass"),
    "mutant-ds-step-loss-scaled-by-gas-twice": (4, 2, "sgd", "n/a", "pass"),
    # DP 4: at DP 2 the masks leave every valid token on rank 0 (the last replica holds none), whose
    # own count is then the global one and a local-count bug cannot show across degrees
    "hf-trainer-llama": (4, 4, "sgd", "pass", "pass"),
    "hf-trainer-qwen2": (4, 4, "adamw", "pass", "pass"),
    "hf-trainer-llama-user-loss": (4, 4, "sgd", "pass", "pass"),
    "hf-trainer-llama-label-smoothing": (4, 4, "sgd", "pass", "pass"),
    "mutant-hf-trainer-mean-of-micro-batch-means": (4, 4, "sgd", "fail", "fail"),
    "mutant-hf-trainer-4470-training-step": (4, 4, "sgd", "fail", "fail"),  # K x W x the token mean
    "mutant-hf-trainer-label-smoother-per-micro-batch": (4, 4, "sgd", "fail", "fail"),
    "trl-sft-llama": (4, 4, "sgd", "pass", "pass"),
    # the prompt trained on is a different token set, each normalised right: no invariance moves
    "mutant-trl-sft-prompt-trained": (4, 4, "sgd", "pass", "pass"),
    # CP 2 has no one-rank twin (its sequence group would be one rank)
    "mcore-gpt-cp-step": (4, 2, "sgd", "pass", "n/a"),
    "mcore-gpt-sp-step-sinks": (2, 1, "sgd", "pass", "pass"),
    # the SP steps below at K = 2 (the SP adapter draws a multiple of SP micro-batches); the HF
    # Trainer's and the SFTTrainer's under SP cannot drop the first accumulation, and each SP bug
    # there is a factor or a token set the one-rank run does not share
    "hf-trainer-sp-llama": (4, 2, "sgd", "n/a", "pass"),
    "mutant-hf-trainer-sp-accumulation-count-times-sp": (4, 2, "sgd", "n/a", "fail"),
    "mutant-hf-trainer-sp-count-divided-by-sp": (4, 2, "sgd", "n/a", "fail"),
    "mutant-hf-trainer-sp-duplicate-data": (4, 2, "sgd", "n/a", "fail"),
    "trl-sft-sp-llama": (4, 2, "sgd", "n/a", "pass"),
    "mutant-trl-sft-sp-count-divided-by-sp": (4, 2, "sgd", "n/a", "fail"),
    "verl-sft-sp-llama": (4, 2, "sgd", "pass", "pass"),
    # each rank keeps its own shard's grad: K = 1 packs other tokens into each shard than K = 2
    "mutant-verl-sp-grads-not-synced-over-sp": (4, 2, "sgd", "fail", "fail"),
    "mutant-verl-sp-dp-size-as-world-size": (4, 2, "sgd", "pass", "fail"),  # x SP at every K
    "mutant-verl-sp-ranks-see-different-sequences": (4, 2, "sgd", "fail", "fail"),
}
"""Every built-in framework step and framework step mutant, and what each invariance says of it."""

SP_STEPS = {name for name in SWEEP if "-sp-" in name and ("hf-trainer" in name or "trl" in name or "verl" in name)}
"""The post-training SP steps (issue 63): K = 2, a multiple of SP."""

NOT_APPLICABLE_BECAUSE = {
    **{name: FIXED_K for name in SWEEP if name.startswith(("ds-", "mutant-ds-"))},
    **{name: "no call that drops an accumulated step" for name in SP_STEPS if "verl" not in name},
    "mcore-gpt-cp-step": "sequence group is world_size / dp = 1",
}
"""What each n/a of the sweep names: why that invariance cannot apply to that step."""


def test_the_sweep_covers_every_framework_step():
    here = [module for module in FRAMEWORK_CASES if _installed(module)]
    # a release case is its base's step at the config that shows a release's bug: its base is swept
    steps = {name for module in here for name in FRAMEWORK_CASES[module][1]
             if get_case(name).train_loss is not None and "release" not in get_case(name).tags}
    assert steps == {name for name in SWEEP if _framework(name) in here}, sorted(steps ^ set(SWEEP))
    assert {name for name, (*_, acc, deg) in SWEEP.items() if "n/a" in (acc, deg)} == set(NOT_APPLICABLE_BECAUSE)


def test_the_trainers_sp_step_is_compared_with_its_one_rank_run(sp_pool):
    # the one-rank twin takes the Trainer's DDP path (no SP adapter, no shift_labels): the user
    # code reads either; the x sp_size token count (#46775) shows against it without a reference
    for case, expected in [("hf-trainer-sp-llama", "pass"), ("mutant-hf-trainer-sp-count-divided-by-sp", "fail")]:
        # two steps, as the SP path's other tests (hf_sp_path.sp_config): the count shows at the first
        outcome = _invariances(sp_pool, case, ("degree-invariance",), world_size=4, dp=2, micro_batches=2,
                               steps=2)["degree-invariance"]
        assert outcome.status == expected, (case, outcome.detail)
    assert outcome.detail.startswith("reported loss"), outcome.detail


def test_a_step_that_runs_only_on_its_parallel_path_is_an_error_of_the_twin_not_a_fail(sp_pool):
    # the README's SP example reads the adapter's shift_labels, which one rank is never handed:
    # the check could not compare, so ERROR naming the twin, never FAIL of a correct step
    _needs("accelerate")
    config = CheckConfig(case=os.path.join(ROOT, "examples", "hf_trainer_sp_step.py") + ":SP", train_step=True,
                         world_size=4, dp=2, micro_batches=2, dtype="float32", optimizer="sgd", timeout_s=TIMEOUT_S)
    outcome = run_check(get_check("degree-invariance"), config, sp_pool)
    assert outcome.status == "error" and outcome.caught_by == "twin", outcome.detail
    assert "crashed on one rank" in outcome.detail and "shift_labels" in outcome.detail, outcome.detail


@pytest.mark.exhaustive("the fast tier runs the HF Trainer's step and its mean-of-means mutant through "
                        "accumulation invariance, megatron's step through degree invariance, and the n/a of K = 1, "
                        "of world size 1 and of a step fixed at TP 2")
@pytest.mark.parametrize("case", sorted(SWEEP))
def test_every_framework_step_and_mutant_through_both_invariances(sp_pool, case):
    world_size, dp, optimizer, *expected = SWEEP[case]
    more = {"micro_batches": 2} if case in SP_STEPS else {}
    outcomes = _invariances(sp_pool, case, world_size=world_size, dp=dp, optimizer=optimizer, **more)
    assert _statuses(outcomes) == expected, _details(outcomes)
    for outcome in outcomes.values():
        if outcome.status == "n/a":
            assert NOT_APPLICABLE_BECAUSE[case] in outcome.detail, outcome.detail
