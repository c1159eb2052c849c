"""The default battery kills every mutant in the catalogue, each by its pinned check and entry:
one test per mutant, so a change that blinds a check (a loosened tolerance, a skipped
comparison) or moves a kill to another check fails CI by name. A correct twin failing an entry
is a battery error, never a silent skip.

The fast tier runs each mutant's pinned entry alone (its twin passes it, the mutant fails it at
the pinned check); the full tier runs the battery from its first entry, so it also proves that no
earlier entry kills the mutant (a kill moving earlier is a change to review, not a blind check)."""

import pytest

from sp_harness.suites.battery import Battery, mutant_names

EXPECTED_KILLER = {
    "mutant-train-mean-of-means": ("reported loss", "train-step"),
    "mutant-train-drop-middle-microbatches": ("grads before clipping", "train-step"),
    "mutant-train-cp-local-count": ("reported loss", "train-step"),
    "mutant-train-dp-local-count": ("reported loss", "train-step"),
    "mutant-train-clip-missing-param": ("grad norm", "train-step"),
    "mutant-train-norm-avg-shards": ("grad norm", "train-step"),
    "mutant-train-loss-times-sp": ("reported loss", "train-step"),
    "mutant-train-sp-grads-unsynced": ("grads before clipping", "train-step"),
    "mutant-train-ga-times-sp": ("grads before clipping", "train-step"),
    "mutant-train-logged-loss-per-rank": ("reported loss", "train-step"),
    "mutant-hf-trainer-mean-of-micro-batch-means": ("reported loss", "train-step-dp"),
    "mutant-hf-trainer-4470-training-step": ("reported loss", "train-step-dp"),
    "mutant-ds-step-offload-drops-middle": ("grads before clipping", "train-step"),
    "mutant-ds-step-offload-multi-backward-keeps-last": ("grads before clipping", "train-step"),
    "mutant-ds-step-loss-scaled-by-gas-twice": ("grads before clipping", "train-step"),
    "mutant-ds-ulysses-batch-dim-idx": ("forward", "even"),
    "mutant-ds-ulysses-detached-a2a": ("grad", "even"),
    "mutant-ds-ulysses-engine-without-sp-group": ("grad", "even"),
    "mutant-ds-ulysses-scatter-gather-swapped": ("forward", "even"),
    "mutant-dtensor-norm-init-per-rank": ("init", "even"),
    "mutant-mcore-step-local-token-mean": ("grads before clipping", "train-step-f32"),
    "mutant-mcore-step-clip-norm-tp-rank0": ("grad norm", "train-step-f32"),
    "mutant-mcore-ddp-sync-only": ("grad", "even"),
    "mutant-mcore-norm-flag-dropped": ("grad", "even"),
    "mutant-mcore-row-bias-flag-dropped": ("grad", "even"),
    "mutant-dtensor-norm-missing-sp": ("grad", "even"),
    "mutant-dtensor-output-wrong-dim": ("crash", "even"),
    "mutant-ring-balancer-assumes-causal": ("forward", "noncausal"),
    "mutant-ring-dkv-not-sent-back": ("grad", "even"),
    "mutant-ring-loss-per-rank-norm": ("forward (loss)", "uneven"),
    "mutant-ring-lse-base2": ("attention lse", "even"),
    "mutant-ring-mask-ignores-zigzag": ("forward", "even"),
    "mutant-ring-merge-by-max": ("forward", "even"),
    "mutant-ring-positions-bf16": ("forward", "bf16"),
    "mutant-ring-zigzag-drops-tail": ("forward", "uneven"),
    "mutant-ring-zigzag-unbalanced": ("load balance", "balance"),
    "mutant-sp-clip-norm-counts-replicas": ("lockstep gate", "lockstep"),
    "mutant-sp-collectives-assume-even": ("crash", "uneven"),
    "mutant-sp-even-shard-positions": ("forward", "uneven"),
    "mutant-sp-full-sequence-norms": ("collective accounting", "comm-vs-tp"),
    "mutant-sp-gather-backward-split": ("grad", "even"),
    "mutant-sp-gather-dim0-bsh": ("forward", "even"),
    "mutant-sp-gather-wrong-order": ("forward", "even"),
    "mutant-sp-local-positions": ("forward", "even"),
    "mutant-sp-loss-mean-per-rank": ("forward (loss)", "uneven"),
    "mutant-sp-no-embedding-grad-sync": ("grad", "even"),
    "mutant-sp-no-norm-grad-sync": ("grad", "even"),
    "mutant-sp-no-row-bias-grad-sync": ("grad", "even"),
    "mutant-sp-norm-grad-sync-dp-group": ("grad", "even"),
    "mutant-sp-norm-sync-lost-at-step-3": ("grad", "even"),
    "mutant-sp-positions-bf16": ("forward", "bf16"),
    "mutant-sp-reduce-scatter-world": ("crash", "dp2xtp2"),
    "mutant-sp-row-bias-before-reduce": ("forward", "even"),
    "mutant-titan-embedding-partial-as-replicate": ("forward", "even"),
    "mutant-titan-fsdp-grads-summed-over-dp": ("grad", "dp2xtp2"),
    "mutant-titan-norm-sp-dropped": ("crash", "even"),
    "mutant-tp-all-reduce-world": ("forward", "dp2xtp2"),
    "mutant-tp-row-bias-before-reduce": ("forward", "even"),
    "mutant-ulysses-a2a-assumes-even": ("crash", "uneven"),
    "mutant-ulysses-backward-forward-splits": ("crash", "uneven"),
    "mutant-ulysses-gqa-kv-heads-tiled": ("forward", "uneven"),
    "mutant-ulysses-label-shift-per-shard": ("forward (loss)", "even"),
    "mutant-ulysses-local-positions": ("forward", "even"),
    "mutant-ulysses-loss-mean-per-rank": ("forward (loss)", "uneven"),
    "mutant-ulysses-no-sp-grad-sync": ("grad", "even"),
    "mutant-ulysses-positions-bf16": ("forward", "bf16"),
    "mutant-usp-grad-sync-ring-only": ("grad", "uneven"),
    "mutant-usp-positions-bf16": ("forward", "bf16"),
    "mutant-usp-ring-low-groups": ("forward", "2x2"),
    "mutant-usp-zigzag-over-sp": ("forward", "uneven"),
    "mutant-yc-causal-mask-on-received-blocks": ("forward", "even"),
    "mutant-yc-grad-sync-ulysses-only": ("grad", "even"),
    "mutant-yc-ring-merge-overwrites": ("forward", "even"),
    "mutant-yc-zigzag-contiguous-shards": ("forward", "even"),
}
"""mutant -> (check that kills it first, battery entry). Pinned from `sp-harness mutants`."""


@pytest.fixture(scope="session")
def battery(sp_pool, tmp_path_factory):
    return Battery(sp_pool)


def test_catalogue_is_large_enough():
    assert len(mutant_names()) >= 12


FRAMEWORK_OF = {"mutant-mcore-": "megatron.core", "mutant-yc-": "yunchang", "mutant-titan-": "torchtitan",
                "mutant-ds-": "deepspeed", "mutant-hf-trainer-": "accelerate"}
"""A framework mutant's name prefix -> the module its framework installs (its cases register
only where it is installed; the README's test command installs them all)."""


def test_every_mutant_has_a_pinned_killer():
    from sp_harness.cases.frameworks import installed

    def registered_here(name):
        module = next((m for prefix, m in FRAMEWORK_OF.items() if name.startswith(prefix)), None)
        return module is None or installed(module)

    assert sorted(m for m in EXPECTED_KILLER if registered_here(m)) == mutant_names()


@pytest.mark.parametrize("mutant", mutant_names())
def test_mutant_is_killed_by_its_pinned_check(battery, tier, mutant):
    outcome = battery.kill(mutant, only=EXPECTED_KILLER[mutant][1] if tier == "fast" else None)
    assert not outcome.twin_failures, outcome.detail
    assert outcome.status == "KILLED", f"{mutant} survived the default battery: {outcome.models_bug}"
    assert (outcome.killed_by, outcome.entry) == EXPECTED_KILLER[mutant], outcome.detail
