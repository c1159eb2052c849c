"""Placing a param-grad failure before or after the grad sync from the grads backward left
(sp_harness.compare.presync), on recorded tensors: no ranks. The real-rank placements of the
framework mutants are in docs/localization.md; the megatron final-norm one is pinned below."""

import pytest
import torch
from torch import nn

from sp_harness.capture.trace import Recorder, Trace
from sp_harness.compare.divergence import first_divergence
from sp_harness.compare.presync import Placement, PreSyncGrad, place
from sp_harness.compare.tolerance import RefPieces
from sp_harness.step.precision import precision_of

F64 = precision_of(torch.float64)


def _refs(full: dict[str, torch.Tensor]):
    # the float32 reference's rounding of each grad: what the bound is measured from
    return lambda name: RefPieces(r64=full[name], lp=full[name].float().double(), alt=None)


def _grads(per_rank: dict[int, dict[str, torch.Tensor]]) -> list[PreSyncGrad]:
    return [PreSyncGrad(rank=r, name=n, piece="whole", grad=g) for r, gs in per_rank.items() for n, g in gs.items()]


def _after(grads: dict[str, torch.Tensor | None]):
    # this rank's grads after the sync, in its piece's shape
    return lambda name: grads.get(name)


def _shares(seed: int, shape=(8, 6)):
    """Two SP ranks' shares of one replicated weight's grad: each its own tokens' terms."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def test_a_missing_or_wrong_sync_is_placed_in_the_sync_with_the_weights_that_fit():
    a0, a1 = _shares(0)
    b0, b1 = _shares(1)
    full = {"norm.weight": a0 + a1, "proj.weight": (b0 + b1) / 2}  # a sum over SP; a mean over DP
    every = _grads({0: {"norm.weight": a0, "proj.weight": b0}, 1: {"norm.weight": a1, "proj.weight": b1}})
    # the sync left rank 0's own share of the norm grad: never summed
    got = place(step=0, rank=0, every=every, order=["proj.weight", "norm.weight"], failing=["norm.weight"],
                refs=_refs(full), after=_after({"norm.weight": a0, "proj.weight": (b0 + b1) / 2}), precision=F64)
    assert got.stage == "grad sync" and got.param == "norm.weight"
    assert [r for r, _ in got.weights] == [0, 1]
    assert [w for _, w in got.weights] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert "(backward is right): norm.weight's = rank 0's x 1 + rank 1's x 1" in got.describe()


def test_a_grad_wrong_before_the_sync_is_placed_in_backward_first_in_backward_order():
    a0, a1 = _shares(0)
    b0, b1 = _shares(1)
    c0, c1 = _shares(2)
    full = {"embed.weight": a0 + a1, "router.weight": b0 + b1, "experts.weight": c0 + c1}
    # a wrong router count changes rank 1's grad in shape, not by a factor; the embedding, earlier
    # in forward, is wrong too (the error flows back into it) but comes later in backward
    bad = b1.clone()
    bad[0] *= 3.0
    every = _grads({0: {"embed.weight": a0 + 0.1, "router.weight": b0, "experts.weight": c0},
                    1: {"embed.weight": a1, "router.weight": bad, "experts.weight": c1}})
    got = place(step=0, rank=0, every=every, order=["experts.weight", "router.weight", "embed.weight"],
                failing=["embed.weight", "router.weight"], refs=_refs(full),
                after=_after({"embed.weight": a0 + 0.1 + a1, "router.weight": b0 + bad, "experts.weight": c0 + c1}),
                precision=F64)
    assert got.stage == "backward" and got.param == "router.weight" and got.ratio > 1e3


def test_zero_grads_from_a_detached_exchange_fit_nowhere():
    a0, a1 = _shares(3)
    full = {"q.weight": a0 + a1}
    every = _grads({0: {"q.weight": torch.zeros_like(a0)}, 1: {"q.weight": torch.zeros_like(a1)}})
    got = place(step=0, rank=0, every=every, order=["q.weight"], failing=["q.weight"], refs=_refs(full),
                after=_after({"q.weight": torch.zeros_like(a0)}), precision=F64)
    assert got.stage == "backward"


def test_what_cannot_be_judged_is_unknown_not_a_guess():
    # 4 elements over 2 holders: two weights fit most 4-element targets, so nothing is learnt
    a0, a1 = _shares(4, shape=(4,))
    every = _grads({0: {"b": a0}, 1: {"b": a1}})
    got = place(step=0, rank=0, every=every, order=["b"], failing=["b"], refs=_refs({"b": a0 * 3 - a1}),
                after=_after({"b": a0 + a1}), precision=F64)
    assert got.stage == "unknown" and "could not place" in got.describe()
    # no grad after backward on a holder (a ZeRO stage that frees it): unknown, named
    w0, w1 = _shares(5)
    every = _grads({0: {"w": w0}}) + [PreSyncGrad(rank=1, name="w", piece="whole", grad=None)]
    got = place(step=0, rank=0, every=every, order=["w"], failing=["w"], refs=_refs({"w": w0 + w1}),
                after=_after({"w": w0}), precision=F64)
    assert got.stage == "unknown" and "w (no grad after backward" in got.note
    # a reference grad of rounding only (a key bias's: zero in exact arithmetic) says nothing
    # (the float32 reference's is its own rounding noise, far above the float64 one's)
    tiny = torch.full((8, 6), 1e-18, dtype=torch.float64)
    refs = RefPieces(r64=tiny, lp=tiny + 1e-9 * w0, alt=None)
    every = _grads({0: {"k.bias": w0}, 1: {"k.bias": w1}})
    got = place(step=0, rank=0, every=every, order=["k.bias"], failing=["k.bias"], refs=lambda n: refs,
                after=_after({"k.bias": w0 + w1}), precision=F64)
    assert got.stage == "unknown"


def test_no_grad_on_any_holder_where_others_have_one_is_backward():
    # a detached all-to-all leaves q's grad None on every rank, while the MLP's grads exist
    a0, a1 = _shares(6)
    b0, b1 = _shares(7)
    every = _grads({0: {"mlp.weight": a0}, 1: {"mlp.weight": a1}}) + [
        PreSyncGrad(rank=r, name="q.weight", piece="whole", grad=None) for r in (0, 1)]
    got = place(step=0, rank=0, every=every, order=["mlp.weight", "q.weight"], failing=["q.weight"],
                refs=_refs({"mlp.weight": a0 + a1, "q.weight": b0 + b1}),
                after=_after({"mlp.weight": a0 + a1, "q.weight": None}), precision=F64)
    assert got.stage == "backward" and got.param == "q.weight" and "no grad reached q.weight" in got.describe()


def _empty_trace() -> Trace:
    return Trace(forward={"norm": torch.ones(2, 4, dtype=torch.float64)}, order=["norm"])


def test_the_divergence_reads_the_placement_and_drops_island_hints_for_a_sync_error():
    t = _empty_trace()
    kw = dict(step=0, rank=1, sharded=t, ref64=t, ref_lp=t, ref_alt=t, dtype=torch.float64, seq_len=4,
              seq_shards=(2, 2), tp_rank=0, failed_kind="grad")
    sync = Placement(stage="grad sync", param="final_layernorm.weight", weights=((0, 1.0), (1, 1.0)))
    d = first_divergence(**kw, presync=sync)
    assert d.phase == "sync" and d.module == "final_layernorm.weight"
    assert d.describe().startswith("the error enters in the grad sync at step 0 (rank 1)")
    assert not d.could_cause("module.rotary_pos_emb", backward=False)
    back = Placement(stage="backward", param="mlp.router.weight", ratio=5e4)
    d = first_divergence(**kw, presync=back)
    assert d.phase == "backward" and d.module == "mlp.router" and d.param == "mlp.router.weight"
    assert "first module with wrong param grads before the grad sync: mlp.router" in d.describe()
    # its forward ops' roundings agreed; a backward op inside the router may have caused it
    assert not d.could_cause("module.mlp.router", backward=False)
    assert d.could_cause("module.mlp.router", backward=True) and not d.could_cause("attn", backward=True)
    d = first_divergence(**kw)
    assert d.phase == "none" and "were not kept" in d.describe()


class _Pair(nn.Module):
    """A megatron-style layer: returns (output, bias)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lin(x), None


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _Pair()

    def forward(self, x):
        out, _ = self.mlp(x)
        return torch.tanh(out)


def test_a_module_returning_output_and_bias_is_traced_by_its_output():
    model = _Block()
    rec = Recorder(model, skip=frozenset({"mlp.lin"}))
    model(torch.randn(2, 4))
    assert "mlp" in rec.forward and "mlp.lin" not in rec.forward


def test_a_whole_shaped_input_grad_that_may_be_partial_is_not_compared():
    # the sharded experts' input grad is half the reference's (a TP partial sum): with the
    # experts named in partial it is not taken for the divergence
    ref = Trace(backward={"experts": torch.ones(4, 4, dtype=torch.float64)})
    got = Trace(backward={"experts": torch.full((4, 4), 0.5, dtype=torch.float64)})
    kw = dict(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64, seq_len=4,
              seq_shards=(2, 2), tp_rank=0, failed_kind="grad")
    assert first_divergence(**kw).phase == "backward"
    assert first_divergence(**kw, partial=frozenset({"experts"})).phase == "none"


def test_a_param_right_after_the_sync_that_fits_nowhere_before_it_makes_the_placement_unknown():
    # what megatron's DDP showed at DP 2 x TP 2 in a correct run: the position embedding's grads
    # before the sync are not in the span the sync combines; nothing is placed by such grads
    a0, a1 = _shares(8)
    b0, b1 = _shares(9)
    full = {"pos.weight": a0 + a1 + 1.0, "norm.weight": b0 + b1}
    every = _grads({0: {"pos.weight": a0, "norm.weight": b0 * 2}, 1: {"pos.weight": a1, "norm.weight": b1}})
    got = place(step=0, rank=0, every=every, order=["norm.weight", "pos.weight"], failing=["norm.weight"],
                refs=_refs(full), after=_after({"norm.weight": b0 * 2 + b1, "pos.weight": full["pos.weight"]}),
                precision=F64)
    assert got.stage == "unknown" and got.note.startswith("pos.weight's grads before the sync"), got


def test_ops_inside_a_declared_island_are_no_candidate_cause():
    # yunchang's float32 ring merge at float64, declared: the perturbed reference rounds the whole
    # core at float32, so the ops found inside it are modelled (the declared island itself is
    # named where it holds the divergence); a float32 op outside it still is a candidate
    ref = Trace(forward={"attn.core": torch.ones(2, 4, dtype=torch.float64)}, order=["attn.core"])
    got = Trace(forward={"attn.core": torch.full((2, 4), 2.0, dtype=torch.float64)}, order=["attn.core"])
    kw = dict(step=0, rank=0, sharded=got, ref64=ref, ref_lp=ref, ref_alt=ref, dtype=torch.float64, seq_len=4,
              seq_shards=(2, 2), tp_rank=0, failed_kind="forward")
    d = first_divergence(**kw, declared=("attn.core",))
    assert d.module == "attn.core" and not d.could_cause("module.attn.core.usp", backward=False)
    assert d.could_cause("attn.core_proj", backward=False)  # a prefix is a module, not a string
    assert first_divergence(**kw).could_cause("attn.core.usp", backward=False)


def test_identical_holders_fit_megatrons_position_embedding_at_dp_2_x_tp_2():
    # both TP ranks of a replica hold the same grad (the sequence scatter's backward all-gathers
    # it): rank-deficient columns, where torch.linalg.lstsq's default driver missed 0.5 g0 + 0.5 g2
    # (residual 0.31 of 0.50 on a correct mcore-gpt-sp run), so a right sync read 'could not place'
    a, b = _shares(10, shape=(16, 32))
    full = {"pos.weight": (a + b) / 2}
    every = _grads({0: {"pos.weight": a}, 1: {"pos.weight": a}, 2: {"pos.weight": b}, 3: {"pos.weight": b}})
    # the sync never averaged over DP: rank 0 keeps its replica's grad
    got = place(step=0, rank=0, every=every, order=["pos.weight"], failing=["pos.weight"], refs=_refs(full),
                after=_after({"pos.weight": a}), precision=F64)
    assert got.stage == "grad sync", got.describe()
    assert sum(w for _, w in got.weights) == pytest.approx(1.0)
