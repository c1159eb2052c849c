"""A param-grad failure that nothing gathered places reads "cannot place", with the numbers, never
a stage it did not show (issue 61, item 8). megatron-core 0.16.1's own label smoothing at TP 2
(the local vocab shard's statistics) in bfloat16: the loss's error is below what bfloat16
resolves there, the grads show it, and before this it read "the error enters in the grad sync"
(the grads before the sync fit the reference within their bound, and that alone named the sync).
Now the sync is named only where its result lies beyond the grad's bound from that fit, and a
case whose backward starts from a multiple of its loss (megatron's calculate_per_token_loss) has
its input grads compared at the scale the first ones agree on (docs/localization.md)."""

import pytest
import torch

from sp_harness.capture.trace import Trace
from sp_harness.cases.frameworks import installed
from sp_harness.compare.divergence import first_divergence
from sp_harness.compare.presync import PreSyncGrad, place
from sp_harness.compare.tolerance import RefPieces
from sp_harness.config.check_config import CheckConfig
from sp_harness.judge.verdict import FAIL
from sp_harness.step.precision import precision_of

BF16 = precision_of(torch.bfloat16)
TIMEOUT_S = 120.0
"""As tests/test_megatron_core.py's: megatron-core's import is the case's setup, outside it."""
needs_megatron = pytest.mark.skipif(not installed("megatron.core"),
                                    reason="megatron-core is not installed (pip install -e '.[megatron]')")


def _bf16_refs(full: torch.Tensor) -> RefPieces:
    # the bfloat16 reference's rounding: what a bfloat16 run's bound is measured from
    return RefPieces(r64=full, lp=full.to(torch.bfloat16).double(), alt=None)


def _shares(seed: int, shape=(16, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def test_a_right_sync_of_grads_already_off_is_not_placed_in_the_sync():
    a0, a1 = _shares(0)
    full = a0 + a1
    # both ranks' grads 2% off along a direction of their own (a loss whose smoothing statistics are
    # the shard's): within what bfloat16 resolves elementwise, so the fit passes
    g = torch.Generator().manual_seed(1)
    off0, off1 = (a + 0.02 * torch.randn(a.shape, generator=g, dtype=torch.float64) for a in (a0, a1))
    every = [PreSyncGrad(rank=0, name="w", piece="p", grad=off0), PreSyncGrad(rank=1, name="w", piece="p", grad=off1)]
    kw = dict(step=1, rank=0, every=every, order=["w"], failing=["w"], refs=lambda n: _bf16_refs(full), precision=BF16)
    right = place(**kw, after=lambda n: (off0 + off1).to(torch.bfloat16).double())
    assert right.stage == "unknown" and right.param == "w", right.describe()
    assert "the sync added no error" in right.note and "within what bfloat16 resolves" in right.note, right.note
    t = Trace(forward={"norm": torch.ones(2, 4, dtype=torch.float64)}, order=["norm"])
    d = first_divergence(step=1, rank=0, sharded=t, ref64=t, ref_lp=t, ref_alt=t, dtype=torch.bfloat16, seq_len=4,
                         seq_shards=(2, 2), tp_rank=0, failed_kind="grad", presync=right)
    assert d.phase == "none" and d.describe().startswith("cannot place the error at step 1 (rank 0)"), d.describe()
    assert "grad sync" not in d.describe().split("could not place it")[0], d.describe()
    # the same grads where the sync kept rank 0's share only: its result is off the fit, the sync is named
    dropped = place(**kw, after=lambda n: off0.to(torch.bfloat16).double())
    assert dropped.stage == "grad sync" and dropped.moved > 1.0, dropped.describe()
    assert [w for _, w in dropped.weights] == pytest.approx([1.0, 1.0], abs=0.05)


def _backward(scales: dict[str, float], seed: int = 2):
    """A reference trace and a sharded one whose input grads are `scales` times the reference's."""
    g = torch.Generator().manual_seed(seed)
    ref_grads = {n: torch.randn(4, 8, dtype=torch.float64, generator=g) for n in scales}
    out = {"emb": torch.randn(4, 8, dtype=torch.float64, generator=g)}
    shapes = {n: ((4, 8), torch.float64) for n in scales}
    ref = Trace(forward=out, backward=ref_grads, order=["emb", *scales], inputs=shapes, reached=set(scales))
    got = Trace(forward=dict(out), backward={n: ref_grads[n] * s for n, s in scales.items()}, order=["emb", *scales],
                inputs=shapes, reached=set(scales))
    return ref, got


def test_input_grads_a_uniform_multiple_of_the_reference_are_the_backward_s_scale_not_a_divergence():
    # backward order: final norm, layer 1, layer 0. megatron's calculate_per_token_loss starts
    # backward from the token sum (22 tokens): every input grad is 22x the reference's
    def divergence(scales, failed_kind="grad"):
        ref, got = _backward(scales)
        return first_divergence(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64,
                                seq_len=4, seq_shards=(4,), tp_rank=0, failed_kind=failed_kind)

    d = divergence({"final_norm": 22.0, "layers.1": 22.0, "layers.0": 22.0})
    assert d.phase == "none" and d.input_grad_scale == pytest.approx(22.0), d.describe()
    assert "input grads compared as 22x the reference's" in d.describe(), d.describe()
    # at that scale a module off by 1.5x more is still named
    d = divergence({"final_norm": 22.0, "layers.1": 22.0, "layers.0": 33.0})
    assert (d.phase, d.module) == ("backward", "layers.0"), d.describe()
    # one module's multiple alone (a partial sum completed outside it) is no scale: it is named
    d = divergence({"final_norm": 0.5, "layers.1": 1.0, "layers.0": 1.0})
    assert (d.phase, d.module, d.input_grad_scale) == ("backward", "final_norm", 1.0), d.describe()
    # a failing input-grad check held the input grads to the reference's own scale
    d = divergence({"final_norm": 22.0, "layers.1": 22.0, "layers.0": 22.0}, failed_kind="input_grad")
    assert (d.phase, d.module) == ("backward", "final_norm"), d.describe()


@needs_megatron
def test_megatrons_bf16_label_smoothing_cannot_be_placed(sp_check):
    # step 0 passes in bfloat16; step 1's grads fail (norm-wise, 1.2x) with the loss 0.003x its bound.
    # Its float32 run (steps=1), placed in the loss, is test_megatron_core's
    # test_megatrons_loss_bugs_are_placed_in_the_loss_and_after_the_final_norm, on megatron's worker
    res = sp_check(CheckConfig(case="mutant-mcore-label-smoothing-local-vocab", world_size=2, dtype="bfloat16",
                               steps=2, timeout_s=TIMEOUT_S))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    d = res.divergence
    # 'none' sorts after 'sync' and 'backward' over the ranks: no rank named a stage
    assert d is not None and d.phase == "none", d and d.describe()
    text = d.describe()
    assert text.startswith("cannot place the error at step 1") and "the sync added no error" in text, text
    assert d.input_grad_scale > 10.0, text  # the token sum's backward, not a divergence at the final norm


def _row_three_times(grad):
    grad = grad.clone()
    grad[0] *= 3.0
    return grad


def _one_param_grad_row_wrong(gpt):
    gpt.decoder.layers[1].mlp.linear_fc2.weight.register_hook(_row_three_times)


def _probe():
    from sp_harness.cases.frameworks.megatron.case import megatron_case
    from sp_harness.cases.frameworks.megatron.cases import ISOLATION, LOSS, PER_TOKEN

    return megatron_case("probe-mcore-gpt-sp-loss-one-grad-row", PER_TOKEN, loss=LOSS, smoothing="global",
                         isolation=ISOLATION, edit_model=_one_param_grad_row_wrong)


PROBE = _probe() if installed("megatron.core") else None
"""mcore-gpt-sp-loss (the label-smoothing mutant's correct twin) with one param's grad wrong in
one row, inside backward: loaded by the ranks as a case file."""


@needs_megatron
@pytest.mark.exhaustive("the fast tier runs the backward's scale on recorded tensors and on the bf16 label-smoothing "
                        "mutant (its input grads compared at the token count)")
def test_a_wrong_param_grad_under_a_per_token_loss_is_placed_at_its_param_not_the_final_norm(sp_check):
    # before the backward's scale, the final norm's input grad (22x the reference's) was named, at
    # 21x its bound in bfloat16 and 2e6x in float32
    res = sp_check(CheckConfig(case=f"{__file__}:PROBE", world_size=2, dtype="bfloat16", steps=1,
                               timeout_s=TIMEOUT_S))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    d = res.divergence
    assert d is not None and (d.phase, d.param) == ("backward", "decoder.layers.1.mlp.linear_fc2.weight"), \
        d and d.describe()
