"""DeepSpeed's release range (sp_harness.cases.frameworks.deepspeed.compat): what differs across
0.16.0 to 0.19.8 asked as capabilities, the configs a release cannot run refused before any rank
starts, the step mutants on a release that shipped their bug, and, on a release with #7967, the
controls that show the bug is exactly it (ZeRO-2 offload at K 2, ZeRO-1 offload at K 3 PASS there).
The release cases themselves run in `sp-harness releases` (the tox release matrix, the main job)."""

import os
import pathlib
from types import SimpleNamespace

import pytest
from installed import skip_unless_installed

skip_unless_installed("deepspeed", "DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from sp_harness import Unsupported  # noqa: E402
from sp_harness.cases.frameworks import releases  # noqa: E402
from sp_harness.cases.frameworks.deepspeed import compat  # noqa: E402
from sp_harness.cases.frameworks.deepspeed.cases import BUG_7967  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS  # noqa: E402

TRAIN_STEP = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "deepspeed_train_step.py")


def test_the_installed_release_is_in_range_with_every_api_the_integration_needs():
    assert releases.outside(compat.RELEASES) is None, releases.outside(compat.RELEASES)
    assert releases.probe(compat.__name__) == ()
    lacking = releases.probe("sp_harness.cases.frameworks.deepspeed.optional")
    assert set(lacking) <= set(compat.OPTIONAL), lacking


def test_grouped_query_heads_without_num_kv_heads_only_where_each_tensors_split_is_right():
    # even over SP: query head i (group i * a_kv / a) lands on the rank of its k/v group
    assert compat.gqa_without_num_kv_heads(4, 2, 2) and compat.gqa_without_num_kv_heads(8, 4, 4)
    # plain multi-head attention, even or uneven: every tensor split by the same count
    assert compat.gqa_without_num_kv_heads(3, 3, 2) and compat.gqa_without_num_kv_heads(4, 4, 4)
    # 6 query heads 3/3, 3 k/v heads 2/1: rank 0's query heads 0-2 need groups 0, 0, 1 but rank 1 holds group 2
    assert not compat.gqa_without_num_kv_heads(6, 3, 2)
    assert not compat.gqa_without_num_kv_heads(8, 2, 4)


def _cfg(**fields):
    base = dict(world_size=2, dp=1, num_heads=4, num_kv_heads=None, hidden=48, ring_degree=None, load_balancer=None,
                seq_shards=None, seq_len=12, dtype="float32", causal=True)
    return SimpleNamespace(**{**base, **fields})


def test_a_config_that_needs_num_kv_heads_is_refused_before_any_rank_where_the_release_lacks_it():
    from sp_harness.cases.frameworks.deepspeed.case import ulysses_case

    explicit = ulysses_case("x-explicit", num_kv_heads=2)
    torn = ulysses_case("x-gqa")
    if compat.lacks(compat.NUM_KV_HEADS):
        with pytest.raises(Unsupported, match=r"num_kv_heads=\)"):
            explicit.validate(_cfg())
        with pytest.raises(Unsupported, match="6 query, 3 k/v over sp 2"):
            torn.validate(_cfg(num_heads=6, num_kv_heads=3))
    else:
        explicit.validate(_cfg())
        torn.validate(_cfg(num_heads=6, num_kv_heads=3))
    torn.validate(_cfg(num_kv_heads=2))  # 4 query, 2 k/v heads over SP 2: every release splits them right


class _Optimizer:
    """A stand-in for DeepSpeedZeroOptimizer: `regressed` reads a method's source and rebinds it."""

    gradient_accumulation_steps = 1
    micro_step_id = 1

    def is_gradient_accumulation_boundary(self):
        return True

    def copy_grads_in_partition(self, param):
        if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary():
            return "fixed"
        return "skipped"


class _Shipped(_Optimizer):
    def copy_grads_in_partition(self, param):
        if self.gradient_accumulation_steps > 1:
            return "accumulated"
        return "shipped"


def test_a_step_mutant_reverts_the_fix_or_runs_the_release_that_shipped_the_bug():
    from sp_harness.cases.frameworks.deepspeed.step import regressed

    fixed = _Optimizer()
    regressed(fixed, "7981")
    assert fixed.copy_grads_in_partition(None) == "skipped"  # the gate before #7981: GA 1 never accumulates
    shipped = _Shipped()
    regressed(shipped, "7981")
    assert "copy_grads_in_partition" not in vars(shipped)  # nothing to undo: the release's own method runs

    class Neither(_Optimizer):
        def copy_grads_in_partition(self, param):
            return "a release whose source differs from both"

    with pytest.raises(RuntimeError, match="neither"):
        regressed(Neither(), "7981")


@pytest.mark.parametrize("case, micro_batches", [("ds-ulysses-step-offload", 2), (f"{TRAIN_STEP}:ZERO1_OFFLOAD", 3)],
                         ids=["zero2-offload-k2", "zero1-offload-k3"])
def test_on_a_release_with_7967_the_offload_path_is_right_where_the_bug_does_not_reach(sp_check, case, micro_batches):
    # #7967 loses micro-batches 1..K-2 of ZeRO-2's per-micro-step CPU accumulation: none at K 2, and
    # ZeRO-1 reduces at the boundary only, so these PASS on the release whose K 3 ZeRO-2 offload FAILs
    if not BUG_7967.present():
        pytest.skip("the installed DeepSpeed has #7967's fix (the controls matter where the bug is)")
    res = sp_check(CheckConfig(case=case, train_step=True, micro_batches=micro_batches, world_size=2,
                               dtype="float32", optimizer="sgd", clip_grad_norm=0.01, steps=1, timeout_s=180.0))
    assert res.verdict == PASS, res.reason + res.error


@pytest.mark.parametrize("case", ["release-ds-7967-offload-ga3-drops-middle",
                                  "release-ds-7981-offload-multi-backward-keeps-last",
                                  "release-ds-8317-seq-first-output-layout", "release-ds-6774-output-a2a-uneven-path",
                                  "release-ds-7649-stage0-clip-slim-mpu", "release-ds-7509-zero2-ga-accumulator",
                                  "release-ds-7837-stage0-bf16-loss-scale", "release-ds-stage0-bf16-adamw-init-step"])
def test_each_release_case_fails_at_its_stage_where_the_release_has_the_bug_and_passes_where_fixed(sp_check, case):
    # what `sp-harness releases` runs (the main job on the pinned release, the matrix on the others)
    from sp_harness.config.registry import get_case
    from sp_harness.judge.expect import expected_verdict

    registered = get_case(case)
    config = registered.examples[0].config(case).replace(timeout_s=180.0)
    res = sp_check(config)
    assert res.verdict == expected_verdict(config), res.reason + res.error
    if res.verdict == FAIL:  # the stage as the check's Outcome names it, which killed_by pins
        from sp_harness.checks import side_by_side, train_step

        labels = train_step.STAGE_LABEL if config.train_step else side_by_side.KIND_LABEL
        assert labels.get(res.first_check, res.first_check) == registered.killed_by[0], (res.first_check, res.reason)


def test_the_grad_read_is_bf16_optimizers_accumulation_where_it_keeps_one():
    # before 0.19.8 safe_get_full_grad returned param.grad first: under BF16_Optimizer the last
    # micro-batch's bf16 staging grad, not the fp32 accumulation the optimizer applies
    import torch

    p = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.bfloat16))
    p.grad = torch.zeros_like(p)
    p._hp_grad = torch.arange(6, dtype=torch.float32)
    assert torch.equal(compat.full_grad(p), torch.arange(6, dtype=torch.float32).view(2, 3))
    del p._hp_grad
    assert compat.full_grad(p) is p.grad
