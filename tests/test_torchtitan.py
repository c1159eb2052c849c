"""torchtitan 0.3.0 as a system under test (sp_harness.cases.frameworks.torchtitan.case), on real gloo
ranks: its llama3 under its own TP + SP sharding config (`Module.parallelize`, DTensor backend)
at TP 2 and 4, and DP 2 x TP 2 under its own FSDP2, against the same model unsharded, and a plan bug expressed through torchtitan's
own `ShardingConfig`, which must FAIL at the forward; its spmd_types backend and its qwen3 (the
fast tier runs them through titan-qwen3-spmd-sp's mutant battery entries, tests/test_mutants.py),
its context parallelism (torch's ring through the CPU shim cp_cpu_ring) at CP 2, and what cannot
run on CPU (FlexAttention, CP in float64) UNSUPPORTED before ranks start."""

import os
import pathlib
import re

import pytest
import torch
from installed import skip_unless_installed

skip_unless_installed("torchtitan", "torchtitan is not installed (pip install -e '.[torchtitan]')")

from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = os.path.join(EXAMPLES, "torchtitan_case.py")
SPMD = os.path.join(EXAMPLES, "torchtitan_spmd_types.py")
CP = os.path.join(EXAMPLES, "torchtitan_cp.py")
LOSS = os.path.join(EXAMPLES, "torchtitan_token_loss.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; torchtitan's import is the case's setup, outside it."""


def _config(name: str, example: str = EXAMPLE, **fields) -> CheckConfig:
    return CheckConfig(case=f"{example}:{name}", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("name,world_size,dp,dtype", [
    pytest.param("LLAMA3_SP_TP2", 2, 1, "float32", marks=pytest.mark.exhaustive(
        "the fast tier runs TP 2 here in bfloat16, and titan-llama3-sp at TP 2 (float64) in the mutant battery")),
    pytest.param("LLAMA3_SP_TP4", 4, 1, "float32", marks=pytest.mark.exhaustive(
        "the fast tier runs TP 2, and 4 ranks as DP 2 x TP 2")),
    ("LLAMA3_SP_TP2", 2, 1, "bfloat16"),
    # DP 2 x TP 2: torchtitan's own FSDP2 (apply_fsdp_to_decoder)
    pytest.param("LLAMA3_SP_TP2", 4, 2, "float32", marks=pytest.mark.exhaustive(
        "test_mutants runs titan-llama3-sp (the same model and plan) at DP 2 x TP 2 under its FSDP2 in float64, the "
        "twin of mutant-titan-fsdp-grads-summed-over-dp (battery entry dp2xtp2)")),
])
def test_llama3_sequence_parallel_passes(sp_check, name, world_size, dp, dtype):
    res = sp_check(_config(name, world_size=world_size, dp=dp, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)
    assert not res.drift


def test_float64_passes_with_ropes_float32_island_on_both_sides(sp_check):
    # torchtitan's ComplexRoPE rotates in float32 (`query.float()`, the cache is complex64) and
    # casts back: an island the reference has too, so float64 agrees to ~1e-15 unperturbed; under
    # the reorder adversary a reordered float64 sum can round to the other float32 neighbour in
    # the rope, so the forward differs by up to ~1e-11 relative (measured 1.7e-11), within the bound
    res = sp_check(_config("LLAMA3_GQA_SP_TP2", world_size=2, dtype="float64", adversary="reorder"))
    assert res.verdict == PASS, res.reason + res.error
    assert any("rope" in i.module and i.dtype == "float32" for i in res.islands), res.islands


@pytest.mark.exhaustive("test_mutants kills mutant-titan-embedding-partial-as-replicate (the same plan edit on "
                        "titan-llama3-sp) at the forward, TP 2")
def test_vocab_parallel_embedding_partial_declared_replicate_fails_at_forward(sp_check):
    res = sp_check(_config("EMBEDDING_PARTIAL_AS_REPLICATE", world_size=2, dtype="float32", steps=1))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error
    # the DTensor model is traced, the vocab-parallel embedding too (its output is a DTensor
    # with no Partial placement): it is the first module out
    d = res.divergence
    assert d is not None and d.phase == "forward" and d.module == "tok_embeddings", d and d.describe()


def test_a_run_at_another_tp_is_unsupported_naming_both(sp_check):
    res = sp_check(_config("LLAMA3_SP_TP2", world_size=4))
    assert res.verdict == UNSUPPORTED and "TP 2" in res.reason and "TP 4" in res.reason, res.reason


@pytest.mark.exhaustive("the fast tier runs the spmd_types backend and qwen3 through titan-qwen3-spmd-sp's battery "
                        "entry (TP 2 + SP, float32) and its two mutants, tests/test_mutants.py")
@pytest.mark.parametrize("example,name,dtype", [
    pytest.param(SPMD, "LLAMA3_SPMD_SP", "float32", id="spmd-sp-f32"),
    pytest.param(SPMD, "LLAMA3_SPMD_SP", "bfloat16", id="spmd-sp-bf16"),
    # no SP: nothing is R on TP, so sync_grads reduces nothing
    pytest.param(SPMD, "LLAMA3_SPMD_TP", "float32", id="spmd-tp-f32"),
    # qwen3 on the DTensor backend: DTensor itself reduces the QK norm's partial grads
    pytest.param(EXAMPLE, "QWEN3_SP_TP2", "float32", id="qwen3-dtensor-f32"),
])
def test_spmd_types_backend_and_qwen3_pass(sp_check, example, name, dtype):
    res = sp_check(_config(name, example, world_size=2, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


@pytest.mark.parametrize("name,dtype,dp", [
    ("LLAMA3_CP2", "float32", 1),
    # DP 2 x CP 2: FSDP over torchtitan's "fsdp" axis (dp x cp flattened), its division by DP set
    pytest.param("LLAMA3_CP2", "float32", 2, id="dp2xcp2", marks=pytest.mark.exhaustive(
        "the fast tier runs titan-llama3-cp at DP 2 x CP 2 as the twin of mutant-titan-cp-fsdp-grads-summed-over-dp")),
    pytest.param("LLAMA3_CP2", "bfloat16", 1, marks=pytest.mark.exhaustive("the fast tier runs CP 2 in float32")),
    pytest.param("LLAMA3_GQA_CP2", "float32", 1, marks=pytest.mark.exhaustive(
        "the fast tier runs CP 2 without GQA; the GQA ring moves half the K/V")),
])
def test_context_parallel_passes_through_torchs_ring(sp_check, name, dtype, dp):
    # torchtitan's own CP path (apply_cp_to_forward, its head-tail cut, FSDP2 over the CP mesh)
    # with torch's ring attention on the CPU kernel (cp_cpu_ring): the ring's backward sends the
    # K/V grads round with all-to-all, once per ring step (2 at CP 2) in each of the 2 layers,
    # which nothing else in this model sends
    res = sp_check(_config(name, CP, world_size=2 * dp, dp=dp, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)
    assert {(r.phase, r.kind): r.count for r in res.comm}.get(("backward", "all_to_all")) == 4, res.comm


@pytest.mark.parametrize("name,fields", [
    # the vocab-parallel logits as plain local shards: torchtitan's _LossParallelCrossEntropy on them
    pytest.param("SFT_SPMD", dict(dtype="float32"), id="spmd-f32"),
    # the CP rank's head-tail sequence shard, its replica's valid tokens counted across CP
    pytest.param("SFT_CP", dict(dtype="float32"), id="cp-f32"),
    # your own loss on the whole logits (the DTensor gathered), float64 (no float32 cast on the way)
    pytest.param("OWN_Z_LOSS", dict(dtype="float64"), id="own-loss-f64"),
    # titan-llama3-sp-loss (TP 2, float32) runs in the mutant battery's entry for its mutant
    pytest.param("SFT_SP", dict(world_size=4, dp=2, dtype="bfloat16"), id="dp2-bf16", marks=pytest.mark.exhaustive(
        "the fast tier runs the loss at DP 1 on each backend; DP 2 x TP 2 runs in titan-llama3-sp's entries")),
])
def test_your_loss_mask_and_loss_function_pass(sp_check, name, fields):
    # a quarter of each sequence's labels and its 2 trailing pads at -100: torchtitan's own loss
    # over the valid tokens agrees with the reference's float64 loss over the same tokens
    res = sp_check(_config(name, LOSS, **{"world_size": 2, **fields}))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)


@pytest.mark.parametrize("loss,message", [
    (dict(label_smoothing=0.1), "has no label smoothing: give TokenLoss(loss_fn=...)"),
    (dict(ignore_index=-1), "TokenLoss.ignore_index -1; torchtitan's cross entropy and its trainer's valid-token "
                            "count skip -100 only"),
])
def test_a_loss_torchtitan_cannot_compute_is_refused_at_construction(loss, message):
    from sp_harness.cases.frameworks.token_loss import TokenLoss
    from sp_harness.cases.frameworks.torchtitan.case import torchtitan_case

    with pytest.raises(ValueError, match=re.escape(message)):
        torchtitan_case("titan-loss", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64), loss=TokenLoss(**loss))


@pytest.mark.parametrize("example,name,fields,reason", [
    pytest.param(LOSS, "SFT_SP", dict(dtype="float64"), "cross_entropy_loss casts the logits to float32",
                 id="loss-float64"),
    pytest.param(CP, "LLAMA3_CP2", dict(dtype="float64"), "merges the per-block attention outputs in float32",
                 id="cp-float64"),
    pytest.param(SPMD, "LLAMA3_SPMD_SP", dict(dtype="float64"), "_LossParallelCrossEntropy", id="spmd-float64"),
    pytest.param(SPMD, "LLAMA3_SPMD_SP", dict(world_size=4, dp=2, dtype="float32"), "pytorch/pytorch#181519",
                 id="spmd-dp2"),
])
def test_what_cannot_run_here_is_unsupported_before_ranks_start(sp_check, example, name, fields, reason):
    res = sp_check(_config(name, example, **{"world_size": 2, **fields}))
    assert res.verdict == UNSUPPORTED and reason in res.reason, res.reason


@pytest.mark.parametrize("fields,reason", [
    (dict(dtype="float32"), "FlexAttention does not support backward on CPU"),
    (dict(dtype="float64", forward_only=True), "takes float32, float16 and bfloat16 only"),
])
def test_flex_attention_is_unsupported_with_torchs_reason_outside_a_forward_only_run(fields, reason):
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.torchtitan.case import torchtitan_case

    case = torchtitan_case("titan-flex", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64), tp=2, attn_backend="flex")
    assert case.validate is not None
    with pytest.raises(Unsupported, match=reason):
        case.validate(case.resolve(CheckConfig(case="titan-flex", world_size=2, **fields)))


def test_the_reference_document_mask_is_torchtitans(monkeypatch):
    # the reference's dense mask, read off the positions, against the mask function torchtitan's
    # get_attention_masks builds its BlockMask from (causal AND packed documents), evaluated at
    # every (query, key); the BlockMask's own compile is left out (seconds; the forward-only PASS
    # runs it)
    from torch.nn.attention.flex_attention import create_mask

    from sp_harness.cases.frameworks.torchtitan.case import _build, model_config
    from sp_harness.cases.frameworks.torchtitan.flex import document_mask, document_positions

    model = _build(model_config("llama3", dict(dim=32, n_layers=1, n_heads=4, vocab_size=64), attn_backend="flex"),
                   torch.float32)
    import torchtitan.models.common.decoder as decoder  # after model_config's CPU shim (no triton here)
    positions = document_positions(3, 16, 4, torch.Generator().manual_seed(0))
    assert (positions == 0).sum(-1).tolist() == [4, 4, 4]
    monkeypatch.setattr(decoder, "create_attention_mask", lambda mask_mod, *args, **kwargs: mask_mod)
    theirs = create_mask(model.get_attention_masks(positions=positions), 3, 1, 16, 16, device="cpu")
    assert torch.equal(document_mask(positions), theirs)
    assert not torch.equal(document_mask(positions), document_mask(torch.arange(16).expand(3, 16)))


@pytest.mark.parametrize("dtype", [
    pytest.param("float32", marks=pytest.mark.exhaustive(
        "torch compiles the CPU flex kernel in each rank pool's first forward: 45 s cold, 24 s with the kernel "
        "cached (torchtitan_flex.INDUCTOR_CACHE); the fast tier checks the reference's mask against torchtitan's "
        "(test_the_reference_document_mask_is_torchtitans) and the Unsupported lines")),
    pytest.param("bfloat16", marks=pytest.mark.exhaustive("as float32: the fast tier checks the reference's mask")),
])
def test_flex_attention_with_document_masks_passes_forward_only(sp_check, dtype):
    res = sp_check(_config("FLEX_DOCS", os.path.join(EXAMPLES, "torchtitan_flex.py"), world_size=2, dtype=dtype,
                           forward_only=True))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss"} <= set(res.worst)


@pytest.mark.exhaustive("a flex check compiles torch's CPU kernel (24-45 s); the fast tier checks the reference's mask "
                        "against torchtitan's")
def test_flex_masks_without_the_documents_fail_at_the_forward(sp_check):
    res = sp_check(_config("DOCUMENTS_IGNORED", os.path.join(EXAMPLES, "torchtitan_flex.py"), world_size=2,
                           dtype="float32", forward_only=True, steps=1))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error


def test_cpu_ring_shim_is_opt_in(tmp_path):
    # one gloo rank: inside the block the CPU flash op on Shard(2) DTensors is torch's ring (one
    # block: plain SDPA's numbers, its backward too); outside it, and for a backward whose forward
    # it did not ring, DTensor does what it does without the shim (tests/test_torch_cp.py's pin)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from sp_harness.cases.frameworks.cp_cpu_ring import cpu_ring_attention

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        q, k, v = (torch.randn(2, 4, 8, 8, requires_grad=True) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        local = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        dts = [DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in local]
        with cpu_ring_attention():
            got = F.scaled_dot_product_attention(*dts, is_causal=True)
        got.to_local().sum().backward()
        torch.testing.assert_close(got.to_local(), want)
        for t, g in zip(local, grads, strict=True):
            torch.testing.assert_close(t.grad, g)
        with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
            F.scaled_dot_product_attention(*dts, is_causal=True)
    finally:
        dist.destroy_process_group()


def test_spmd_types_declared_complete_outputs_are_traced():
    # under spmd_types the params are plain tensors, so the trace cannot read a module's output
    # type from placements: the case hands it the modules whose declared output type on TP is
    # complete (the embedding's and the row-parallel linears' reduce-scatter to S(1)), and the
    # #3468 mutant on this backend is placed at tok_embeddings (tests/test_mutants.py kills it)
    from sp_harness.cases.frameworks.torchtitan.case import _build, model_config
    from sp_harness.cases.frameworks.torchtitan.spmd import _whole_outputs

    model = _build(model_config("qwen3", dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64)),
                   torch.float32)
    whole = set(_whole_outputs(model))
    assert {"tok_embeddings", "layers.0.attention.wo", "layers.0.feed_forward.w2"} <= whole, whole
    # column-parallel pieces (heads, the FFN's hidden, the vocab-parallel logits) stay out
    assert not whole & {"layers.0.attention.qkv_linear.wqkv", "layers.0.feed_forward.w1", "lm_head"}, whole


DSV3_SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, num_experts=4, top_k=2, num_shared_experts=1)
"""examples/torchtitan_case.py's DSV3_SP_TP2: MLA, one dense layer, one MoE layer."""


@pytest.mark.exhaustive("the fast tier builds deepseek_v3 and runs its forward and backward in one process "
                        "(test_deepseek_v3_builds_as_torchtitan_builds_it) and its Unsupported lines; TP 2 on ranks "
                        "runs qwen3 and llama3 there")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_deepseek_v3_mla_and_moe_pass_under_its_sharding_config(sp_check, dtype):
    res = sp_check(_config("DSV3_SP_TP2", world_size=2, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "loss", "grad", "param"} <= set(res.worst)
    # GroupedExperts computes in bfloat16 whatever the model's dtype (x.bfloat16() into
    # torch._grouped_mm), on both sides: above bfloat16 the run names that island
    experts = [i for i in res.islands if i.module.endswith("inner_experts") and i.dtype == "bfloat16"]
    assert bool(experts) == (dtype != "bfloat16"), res.islands


@pytest.mark.parametrize("fields,kwargs,reason", [
    pytest.param(dict(num_kv_heads=2), {}, "MLA has no KV heads", id="kv-heads"),
    # dim 40: 40 / 8 elements, but the expert hidden dim (dim) is 20 per TP rank
    pytest.param(dict(hidden=40), {}, "moe_hidden_dim / TP 20", id="grouped-mm-strides"),
    pytest.param(dict(dtype="bfloat16"), dict(moe_hidden_dim=33), "moe_hidden_dim (33) is not divisible",
                 id="expert-hidden-tp"),
    # MLA's v head dim (8) is not its qk head dim (8 + 4): torch's CP ring gets SDPA's math path
    pytest.param({}, dict(context_parallel=2), "v_head_dim 8 != qk head dim 12", id="cp-head-dims"),
])
def test_deepseek_v3_what_cannot_run_is_unsupported_before_ranks_start(fields, kwargs, reason):
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.torchtitan.case import torchtitan_case

    def case_of(**kw):
        cp = kw.pop("context_parallel", 1)
        case = torchtitan_case("titan-dsv3", {**DSV3_SHAPES, **kw}, tp=None if cp > 1 else 2, model="deepseek_v3",
                               context_parallel=cp)
        assert case.validate is not None
        return case, case.validate

    base, validate = case_of()
    validate(base.resolve(CheckConfig(case="titan-dsv3", world_size=2, dtype="float32")))  # DSV3_SP_TP2's PASS
    case, validate = case_of(**kwargs)
    with pytest.raises(Unsupported, match=re.escape(reason)):
        validate(case.resolve(CheckConfig(case="titan-dsv3", world_size=2, **{"dtype": "float32", **fields})))


def test_deepseek_v3_builds_as_torchtitan_builds_it():
    # one process, no ranks: the config torchtitan's sharding config was set on (SDPA swapped in
    # before it, so the inner attention keeps its local map), and a float32 forward and backward
    # through MLA, the dense layer and the MoE layer's router, grouped experts and shared experts
    from sp_harness.cases.frameworks.torchtitan.case import _build, model_config

    config = model_config("deepseek_v3", DSV3_SHAPES)
    from torchtitan.models.common.attention import ScaledDotProductAttention  # after model_config's CPU shim

    dense, moe = config.layers
    assert dense.moe is None and moe.moe is not None and moe.feed_forward is None
    assert isinstance(moe.attention.inner_attention, ScaledDotProductAttention.Config)
    assert moe.attention.inner_attention.sharding_config is not None
    assert moe.moe.routed_experts.inner_experts.sharding_config is not None
    model = _build(config, torch.float32)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, 64) and logits.dtype == torch.float32
    logits.float().logsumexp(-1).sum().backward()
    experts = model.get_submodule("layers.1.moe.routed_experts.inner_experts")
    grads = {name: p.grad for name, p in experts.named_parameters()}
    assert set(grads) == {"w1_EFD", "w2_EDF", "w3_EFD"}
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values()), grads


def test_every_registry_model_is_wired_or_unsupported_with_its_reason():
    # torchtitan's whole registry: a model it adds must be wired (MODELS) or given a reason (UNWIRED)
    from torchtitan.models import _supported_models

    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.torchtitan.case import registry_models, torchtitan_case
    from sp_harness.cases.frameworks.torchtitan.models import UNWIRED

    assert set(_supported_models) == set(registry_models()) | set(UNWIRED), sorted(set(_supported_models))
    assert not set(registry_models()) & set(UNWIRED)
    case = torchtitan_case("titan-gpt-oss", {}, model="gpt_oss")
    with pytest.raises(Unsupported, match=r"gpt_oss is not wired here: its attention sinks .* \(wired: llama3, "):
        case.validate(CheckConfig(case="titan-gpt-oss", world_size=2))


def test_a_release_outside_the_range_is_unsupported_before_any_rank(monkeypatch):
    # the case's validate asks the package's compat (releases.require): a release outside its
    # RELEASES is refused by name and range, before any rank (0.2.2 is, on a real install)
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.releases import ReleaseRange
    from sp_harness.cases.frameworks.torchtitan import compat
    from sp_harness.cases.frameworks.torchtitan.case import torchtitan_case

    case = torchtitan_case("titan-range", dict(dim=32, n_layers=2, n_heads=4, vocab_size=64), tp=2)
    cfg = case.resolve(CheckConfig(case="titan-range", world_size=2, dtype="float32"))
    assert case.validate is not None
    case.validate(cfg)  # the installed release: in range, every API there
    monkeypatch.setattr(compat, "RELEASES", (ReleaseRange(distribution="torchtitan", oldest="99.0", newest="99.1"),))
    with pytest.raises(Unsupported, match=r"titan-range needs torchtitan 99.0 to 99.1\b.*torchtitan \S+ is installed"):
        case.validate(cfg)


def test_missing_names_each_api_the_release_lacks(monkeypatch):
    # compat.missing() asks for what the integration calls (hasattr, inspect.signature): with two
    # APIs taken away as an older release lacks them, it names those two and nothing else. In this
    # process, as test_yunchang's twin of this test: this file's other tests import torchtitan here
    # already, and its import starts no thread (a child interpreter cost 7 s of torch's import)
    from sp_harness.cases.frameworks.torchtitan import compat
    from sp_harness.cases.frameworks.torchtitan.case import cpu_shims

    cpu_shims()
    import torchtitan.distributed.utils as u  # after the CPU shim (no triton here)
    import torchtitan.models.llama3.sharding as s

    assert compat.missing() == (), compat.missing()
    monkeypatch.delattr(s, "set_llama3_sharding_config")
    monkeypatch.delattr(u, "set_spmd_backend")
    assert list(compat.missing()) == [
        "torchtitan.models.llama3.sharding.set_llama3_sharding_config(enable_sp=)",
        "torchtitan.distributed.utils.set_spmd_backend"]
