"""yunchang (0.6.4 pinned; every release of its range in the release matrix) as a system under
test (sp_harness.cases.frameworks.yunchang.case), on real gloo ranks: its LongContextAttention
(USP, zigzag ring) inside the reference GPT against the same GPT with plain attention, on
yunchang's own process groups and token placement; the exact flash-attn stand-in it runs over on
CPU; the releases it runs on (compat); and what was found (docs/frameworks/yunchang.md)."""

import math
import os
import pathlib

import pytest
from installed import skip_unless_installed

skip_unless_installed("yunchang", "yunchang is not installed (pip install -e '.[yunchang]')")

import torch  # noqa: E402

from sp_harness.cases.frameworks import flash_attn_standin as fa  # noqa: E402
from sp_harness.cases.frameworks.yunchang.layout import extract_positions  # noqa: E402
from sp_harness.cases.frameworks.yunchang.shims import import_yunchang  # noqa: E402
from sp_harness.config.check_config import CheckConfig  # noqa: E402
from sp_harness.judge.verdict import FAIL, PASS, UNSUPPORTED  # noqa: E402

EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "yunchang_case.py")
TIMEOUT_S = 120.0
"""Generous for a loaded runner; yunchang's import is the case's setup, outside it."""


def _example(name: str, **fields) -> CheckConfig:
    return CheckConfig(case=f"{EXAMPLE}:{name}", timeout_s=TIMEOUT_S, **fields)


def _builtin(**fields) -> CheckConfig:
    return CheckConfig(case="yc-usp", timeout_s=TIMEOUT_S, **fields)


@pytest.mark.parametrize("causal,sq,sk,kv", [(False, 5, 5, 4), (True, 5, 5, 2), (True, 3, 6, 1)])
def test_flash_attn_standin_is_exact_attention_with_its_lse(causal, sq, sk, kv):
    # flash-attn's contract: out and the natural-log LSE of the scaled scores; causal aligned to
    # the bottom right; the backward from the GIVEN out and lse, writing dq, dk, dv in place
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, sq, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, kv, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, kv, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(8)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4 // kv, 2)) * scale
    if causal:
        s = s.masked_fill(torch.arange(sk)[None] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(4 // kv, 2))
    dout = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    out, lse, _, _ = fa._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, scale, causal, -1, -1, 0.0,
                                            None, False)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    fa._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, *bufs, 0.0, scale, causal, -1, -1,
                            0.0, None, False)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, s.logsumexp(-1), rtol=0, atol=1e-13)
    for got, g in zip(bufs, grads, strict=True):
        torch.testing.assert_close(got, g, rtol=0, atol=1e-13)


@pytest.fixture
def torch_flash():
    fa.use_kernel("torch-flash")
    yield
    fa.use_kernel("exact")


@pytest.mark.skipif(torch.cuda.is_available(), reason="float64 and unequal causal blocks: where a GPU is visible the "
                    "kernel is CUDA's, which takes neither (test_torch_flash_kernel_on_the_gpu)")
@pytest.mark.parametrize("causal,sq,sk,kv", [(False, 5, 7, 4), (True, 6, 6, 2), (True, 6, 3, 1), (True, 3, 6, 4)])
def test_torch_flash_kernel_keeps_flash_attns_contract(torch_flash, causal, sq, sk, kv):
    # torch's flash kernels behind flash-attn's interface: float64 agrees with the exact kernel
    # (bottom-right causal, a row with no key -> 0 and +inf, the backward from the GIVEN out and
    # lse); bfloat16 differs from it, because the kernel rounds the probabilities before P @ V
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, n, h, 8, generator=gen, dtype=torch.float64)
                     for n, h in ((sq, 4), (sk, kv), (sk, kv), (sq, 4)))
    scale = 1 / math.sqrt(8)

    def run(kernel, dtype):
        fa.use_kernel(kernel)
        qd, kd, vd, dd = (t.to(dtype) for t in (q, k, v, dout))
        out, lse, _, _ = fa._flash_attn_forward(qd, kd, vd, 0.0, scale, causal)
        bufs = [torch.empty_like(t) for t in (qd, kd, vd)]
        fa._flash_attn_backward(dd, qd, kd, vd, out, lse, *bufs, 0.0, scale, causal)
        return out, lse, *bufs

    for got, want in zip(run("torch-flash", torch.float64), run("exact", torch.float64), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    flash, exact = run("torch-flash", torch.bfloat16)[0], run("exact", torch.bfloat16)[0]
    assert not torch.equal(flash, exact)
    torch.testing.assert_close(flash.double(), exact.double(), rtol=0, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlashAttention-2 through torch)")
@pytest.mark.parametrize("causal,kv", [(False, 4), (True, 4), (True, 2)])
def test_torch_flash_kernel_on_the_gpu(torch_flash, causal, kv):
    # FlashAttention-2 behind flash-attn's interface, on CPU tensors handed to the GPU and back:
    # bfloat16 out, lse and grads against exact float64 attention, within a few bf16 roundings
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(2, 64, h, 16, generator=gen, dtype=torch.float64) for h in (4, kv, kv, 4))
    scale = 1 / math.sqrt(16)

    def run(dtype):
        qd, kd, vd, dd = (t.to(dtype) for t in (q, k, v, dout))
        out, lse, _, _ = fa._flash_attn_forward(qd, kd, vd, 0.0, scale, causal)
        bufs = [torch.empty_like(t) for t in (qd, kd, vd)]
        fa._flash_attn_backward(dd, qd, kd, vd, out, lse, *bufs, 0.0, scale, causal)
        return out, lse, *bufs

    got = run(torch.bfloat16)
    assert all(t.device.type == "cpu" for t in got)
    fa.use_kernel("exact")
    want = run(torch.float64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=3e-2 * float(w.abs().max()))
    fa.use_kernel("torch-flash")
    with pytest.raises(NotImplementedError, match="6 queries x 3 keys"):
        fa._flash_attn_forward(*(t.to(torch.bfloat16) for t in (q[:, :6], k[:, :3], v[:, :3])), 0.0, scale, True)


def test_a_kernel_name_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="'flash3'"):
        fa.use_kernel("flash3")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.exhaustive(
    "the fast tier runs 2 ranks here, and ulysses 2 x ring 2 in float64 below"))])
def test_usp_on_torchs_flash_kernels_passes_in_bfloat16(sp_check, world_size):
    # yunchang's ring over the kernels its users train with (aten's CPU flash kernel here,
    # FlashAttention-2 where a GPU is visible): the bfloat16 bound holds for them too
    res = sp_check(CheckConfig(case="yc-usp-torch-flash", timeout_s=TIMEOUT_S, world_size=world_size,
                               dtype="bfloat16", adversary="reorder"))
    assert res.verdict == PASS, res.reason + res.error


def test_placement_is_yunchangs_extract_function():
    # basic_extract_local takes the rank as an argument; the zigzag placement (which reads the
    # ranks from yunchang's process groups) is checked against zigzag_extract_local on every rank
    import_yunchang()
    from yunchang import EXTRACT_FUNC_DICT

    pieces = extract_positions("basic", 16, 2, 2, True)
    for rank in range(4):
        theirs = EXTRACT_FUNC_DICT["basic"](torch.arange(16).view(1, -1, 1), rank, world_size=4, rd=2, ud=2)
        assert theirs.reshape(-1).tolist() == pieces[rank].tolist()
    # zigzag, 16 tokens in 4 chunks: ring rank 0 holds chunks 0 and 3, ring rank 1 chunks 1 and 2,
    # each cut between the two Ulysses ranks of its group
    zigzag = extract_positions("zigzag", 16, 2, 2, True)
    assert [p.tolist() for p in zigzag] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("world_size,dp,dtype,adversary", [
    (2, 1, "float64", "reorder"),  # a ring of 2; yunchang's float32 merge declared as an island
    (2, 1, "bfloat16", "off"),  # flash-attn's own dtype
    (4, 1, "float64", "off"),  # ulysses 2 x ring 2
    # DP 2 x ring 2, grads averaged over DP
    pytest.param(4, 2, "bfloat16", "off", marks=pytest.mark.exhaustive(
        "test_mutants runs yc-usp at DP 2 x ring 2 in float64 as the twin of mutant-yc-groups-across-dp-replicas "
        "(battery entry dp2xtp2); the fast tier runs bfloat16 here on a ring of 2")),
])
def test_usp_passes(sp_check, world_size, dp, dtype, adversary):
    res = sp_check(_builtin(world_size=world_size, dp=dp, dtype=dtype, adversary=adversary))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "lse", "loss", "grad", "param"} <= set(res.worst)


def test_float32_ring_backward_aliases_its_accumulator(sp_check):
    # finding: with float32 q, yunchang's `dq = dq_buffer.to(torch.float32)` is the kernel's output
    # buffer itself (no copy), which the next ring step's backward overwrites: the forward is
    # right, the grads are not (float64 and bfloat16 copy, and pass above). Unreachable with real
    # flash-attn, which takes only float16 / bfloat16.
    res = sp_check(_builtin(world_size=2, dtype="float32"))
    assert res.verdict == FAIL and res.first_check == "grad", res.reason + res.error
    assert res.worst["forward"].ratio < 1 and res.worst["lse"].ratio < 1


def test_basic_placement_is_wrong_for_ulysses_high_groups(sp_check):
    # finding: basic_extract_local cuts by SP rank whatever set_seq_parallel_pg's use_ulysses_low
    # says; with use_ulysses_low=False a Ulysses group gathers non-adjacent chunks, and the basic
    # ring's causal schedule (ring rank order = token order) is silently wrong
    res = sp_check(_example("BASIC_ULYSSES_HIGH", world_size=4, forward_only=True))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error


@pytest.mark.exhaustive("the fast tier kills mutant-yc-zigzag-contiguous-shards (the same shard) in test_mutants")
def test_contiguous_shards_into_the_zigzag_ring_fail_at_forward(sp_check):
    res = sp_check(_example("CONTIGUOUS_INTO_ZIGZAG", world_size=2))
    assert res.verdict == FAIL and res.first_check == "forward", res.reason + res.error


@pytest.mark.parametrize("fields,words", [
    (dict(world_size=2, seq_len=10), "zigzag_extract_local"),
    (dict(world_size=3, seq_len=12), "num_heads (4) % ulysses_degree (3)"),
    (dict(world_size=2, causal=False), "causal only"),
    (dict(world_size=2, ring_degree=1), "gloo"),
])
def test_what_yunchang_cannot_run_is_unsupported_with_its_limit(sp_check, fields, words):
    res = sp_check(_builtin(**fields))
    assert res.verdict == UNSUPPORTED and words in res.reason, res.reason


ULYSSES_EXAMPLE = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "yunchang_ulysses.py")


@pytest.mark.parametrize("case,world_size,dtype", [
    ("yc-ulysses", 2, "float32"),  # no ring: no float32 accumulator to alias
    (f"{ULYSSES_EXAMPLE}:ULYSSES", 2, "bfloat16"),  # the user's own model
    pytest.param(f"{ULYSSES_EXAMPLE}:ULYSSES", 2, "float32", marks=pytest.mark.exhaustive(
        "the fast tier runs the example in bfloat16 and yc-ulysses in float32")),
    pytest.param("yc-ulysses", 4, "float64", marks=pytest.mark.exhaustive("the fast tier runs yc-ulysses on 2 ranks")),
    pytest.param("yc-ulysses", 4, "bfloat16", marks=pytest.mark.exhaustive("the fast tier runs yc-ulysses on 2 ranks")),
])
def test_ulysses_attention_passes(sp_check, case, world_size, dtype):
    res = sp_check(CheckConfig(case=case, timeout_s=TIMEOUT_S, world_size=world_size, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert {"forward", "lse", "loss", "grad", "param"} <= set(res.worst)


def test_attn_types_are_yunchangs():
    # every value of the installed release's enum (AttnType; FlashAttentionImpl before 0.6.0) is
    # one the cases classify; a value of another release in range that this one lacks is
    # UNSUPPORTED naming this release's values, never a crash
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.yunchang import compat
    from sp_harness.cases.frameworks.yunchang.case import ATTN_TYPES, attn_type_of, ulysses_case, usp_case

    enum = compat.attn_type_enum()
    installed = {t.value for t in enum}
    assert installed <= set(ATTN_TYPES), installed - set(ATTN_TYPES)
    assert "fa" in installed
    for value in ATTN_TYPES:
        if value in installed:
            assert attn_type_of(value) is enum(value)
        else:
            with pytest.raises(Unsupported, match=f"{value!r} is not one of the installed release's {enum.__name__}"):
                attn_type_of(value)
    with pytest.raises(ValueError, match="'flash9'"):
        attn_type_of("flash9")
    for factory in (usp_case, ulysses_case):
        with pytest.raises(ValueError, match="'flash9'"):
            factory("x", attn_type="flash9")


@pytest.mark.parametrize("name,fields,words", [
    ("FA3", dict(world_size=2), "flash-attn 3's Hopper CUDA kernels"),
    ("USP_TORCH_MATH", dict(world_size=2), "has no backward"),
    ("ULYSSES_TORCH_MATH", dict(world_size=2, forward_only=True), "_scaled_dot_product_flash_attention"),
])
def test_attn_types_that_cannot_run_here_are_unsupported(sp_check, name, fields, words):
    if torch.cuda.is_available() and name != "USP_TORCH_MATH":
        pytest.skip("decided by the ranks' device where a GPU is visible")
    res = sp_check(_example(name, **fields))
    assert res.verdict == UNSUPPORTED and words in res.reason, res.reason


@pytest.mark.exhaustive("the fast tier runs USP_TORCH_MATH's UNSUPPORTED with a backward")
@pytest.mark.parametrize("ring_degree,verdict", [(1, PASS), (2, FAIL)])
def test_torch_math_merges_a_ring_by_zero_lses(sp_check, ring_degree, verdict):
    # finding: yunchang's math path returns an LSE of zeros, so a ring of 2 averages its blocks
    # (forward FAIL, pinned by the case's expect); one block per query (ring 1) is right. A
    # release without the value (the torch path was 'torch' before 0.6.4) says so, in the ranks
    from sp_harness.cases.frameworks.yunchang import compat

    values = [t.value for t in compat.attn_type_enum()]
    res = sp_check(_example("USP_TORCH_MATH", world_size=2, ring_degree=ring_degree, forward_only=True))
    if "torch_math" not in values:
        assert res.verdict == UNSUPPORTED, res.reason + res.error
        assert f"'torch_math' is not one of the installed release's {compat.attn_type_enum().__name__} values" \
               in res.reason, res.reason
        return
    assert res.verdict == verdict, res.reason + res.error
    if verdict == FAIL:
        assert res.first_check == "forward"


def test_a_users_model_under_long_context_attention_declares_its_float32_islands():
    # yunchang's ring merges in float32: at float64 a user's model must name its attention cores
    # as float32 islands, or the run is UNSUPPORTED before any rank starts, naming them
    import importlib.util

    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.yunchang.case import usp_case

    spec = importlib.util.spec_from_file_location("yc_ulysses_example", ULYSSES_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    bare = usp_case("yc-user-usp", model=example.TinyLM)
    cfg = CheckConfig(case="yc-user-usp", world_size=2, dp=1, dtype="float64", ring_degree=2, seq_len=12, hidden=32,
                      ffn=64, num_heads=4, num_layers=2, vocab=64, causal=True)  # resolved, as the engine's
    with pytest.raises(Unsupported, match="'blocks.0.attn', 'blocks.1.attn'"):
        bare.validate(cfg)
    declared = usp_case("yc-user-usp", model=example.TinyLM,
                        precision_islands={"blocks.0.attn": "float32", "blocks.1.attn": "float32"})
    declared.validate(cfg)
    bare.validate(cfg.replace(dtype="bfloat16"))


TOKEN_LOSS = os.path.join(pathlib.Path(__file__).resolve().parent.parent, "examples", "yunchang_token_loss.py")


@pytest.mark.parametrize("name, world_size, dtype", [
    ("ULYSSES_SFT", 2, "float32"),
    pytest.param("USP_SFT", 4, "float64", marks=pytest.mark.exhaustive("the fast tier runs ULYSSES_SFT on 2 ranks")),
])
def test_your_labels_padding_and_smoothing_pass(sp_check, name, world_size, dtype):
    # -100 on a quarter of each sequence and on 2 trailing pads, label smoothing 0.1: each rank's
    # loss is its tokens' sum over the sequence's valid tokens, the reference's in float64
    res = sp_check(CheckConfig(case=f"{TOKEN_LOSS}:{name}", world_size=world_size, dtype=dtype))
    assert res.verdict == PASS, res.reason + res.error
    assert res.worst["loss"].ratio < 1


def test_a_release_outside_the_range_is_unsupported_before_any_rank(monkeypatch):
    # each case's validate asks the package's compat (releases.require): a release outside its
    # RELEASES is refused by name and range, before any rank
    from sp_harness import Unsupported
    from sp_harness.cases.frameworks.releases import ReleaseRange
    from sp_harness.cases.frameworks.yunchang import compat
    from sp_harness.cases.frameworks.yunchang.case import ulysses_case, usp_case

    cfg = CheckConfig(case="yc-range", world_size=2, dp=1, dtype="bfloat16", ring_degree=2, seq_len=12, hidden=32,
                      ffn=64, num_heads=4, num_layers=2, vocab=64, causal=True)  # resolved, as the engine's
    usp, ulysses = usp_case("yc-range"), ulysses_case("yc-range")
    usp.validate(cfg)  # the installed release: in range, every API there
    ulysses.validate(cfg.replace(ring_degree=1))
    monkeypatch.setattr(compat, "RELEASES", (ReleaseRange(distribution="yunchang", oldest="99.0", newest="99.1"),))
    for case, run in ((usp, cfg), (ulysses, cfg.replace(ring_degree=1))):
        with pytest.raises(Unsupported, match=r"yc-range needs yunchang 99.0 to 99.1\b.*yunchang \S+ is installed"):
            case.validate(run)


def test_missing_names_each_api_the_release_lacks(monkeypatch):
    # compat.missing() asks for what the integration calls (hasattr, inspect.signature): with a
    # set_seq_parallel_pg that takes no use_ulysses_low and no UlyssesAttention, it names those two
    # and nothing else
    import yunchang
    import yunchang.globals

    from sp_harness.cases.frameworks.yunchang import compat

    assert compat.missing() == ()
    monkeypatch.setattr(yunchang.globals, "set_seq_parallel_pg", lambda sp_ulysses_degree, sp_ring_degree, rank,
                        world_size: None)
    monkeypatch.delattr(yunchang, "UlyssesAttention")
    assert compat.missing() == ("yunchang.globals.set_seq_parallel_pg(..., use_ulysses_low=)",
                                "yunchang.UlyssesAttention(attn_type=, sequence_process_group=)")
