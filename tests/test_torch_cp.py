"""torch-cp-gpt: PyTorch's own `context_parallel` on the reference GPT, on CPU (torch 2.13).

Its verdicts are pinned as measured (README "What it found"): the ring never runs on CPU, so
the default SDPA fails, and only the math kernel on non-causal, even shards PASSes (through
DTensor's op-by-op sharding). Failures are pinned by exception type and the torch frame they
are raised in, never by torch's wording: the day PyTorch handles CPU SDPA, these tests say so.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer

from sp_harness.cases.ring.placement import rank_positions, zigzag_order
from sp_harness.cases.torch_cp.cases import balanced, torch_placement
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.shards import chunk_sizes
from sp_harness.judge.expect import expected_verdict
from sp_harness.judge.verdict import FAIL, PASS

aten = torch.ops.aten
CP_FRAME = "torch/distributed/tensor/experimental/_context_parallel/_attention.py"
PROPAGATION_FRAME = "torch/distributed/tensor/_sharding_prop.py"


def _frames(traceback: str) -> list[str]:
    """The traceback's `File "..."` lines, innermost last."""
    return [ln.strip() for ln in traceback.splitlines() if ln.strip().startswith("File ")]


# ------------------------------------------------------------------ torch's CP, no ranks

def test_cp_ring_handlers_cover_no_cpu_sdpa_kernel():
    # the ring runs only for the CUDA SDPA kernels; CPU SDPA's op is not among them (upstream pin)
    handled = set(cp_attention.custom_ops)
    assert aten._scaled_dot_product_flash_attention.default in handled
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in handled
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward.default not in handled


@pytest.mark.parametrize("seq_len,cp", [(12, 2), (12, 3), (16, 4), (8, 2)])
def test_torch_placement_is_pytorchs_head_tail_the_2w_zigzag(seq_len, cp):
    shards = chunk_sizes(seq_len, cp)
    assert balanced("zigzag", seq_len, cp)
    assert torch.equal(torch_placement("zigzag")(seq_len, shards), zigzag_order(seq_len, shards))
    # rank 0 holds chunks 0 and 2W-1
    chunk = seq_len // (2 * cp)
    first = rank_positions(torch_placement("zigzag")(seq_len, shards), shards)[0].tolist()
    assert first == list(range(chunk)) + list(range(seq_len - chunk, seq_len))


@pytest.mark.parametrize("seq_len,cp", [(12, 4), (10, 2), (10, 3)])
def test_pytorchs_balancer_silently_falls_back_to_contiguous_unless_2w_divides(seq_len, cp):
    # upstream: _create_default_load_balancer returns None (no error, no warning) when 2W does not
    # divide seq_len, even with enable_load_balance on; our placement follows it
    assert cp_attention._cp_options.enable_load_balance
    assert _create_default_load_balancer(seq_len, cp, "cpu") is None
    assert not balanced("zigzag", seq_len, cp)
    assert torch.equal(torch_placement("zigzag")(seq_len, chunk_sizes(seq_len, cp)), torch.arange(seq_len))


PINNED = [
    # (case, config fields, expected verdict)
    ("torch-cp-gpt", dict(world_size=2), FAIL),
    ("torch-cp-gpt", dict(world_size=2, causal=False), FAIL),
    ("torch-cp-gpt", dict(world_size=4, causal=False, load_balancer="none"), FAIL),
    ("torch-cp-gpt-math", dict(world_size=2, causal=False), PASS),
    ("torch-cp-gpt-math", dict(world_size=3, causal=False), PASS),
    ("torch-cp-gpt-math", dict(world_size=4, causal=False), PASS),
    ("torch-cp-gpt-math", dict(world_size=2, causal=False, load_balancer="none"), PASS),
    ("torch-cp-gpt-math", dict(world_size=2, causal=False, seq_len=10), PASS),
    ("torch-cp-gpt-math", dict(world_size=3, causal=False, seq_len=10), FAIL),
    ("torch-cp-gpt-math", dict(world_size=4, causal=False, seq_len=6), FAIL),
    ("torch-cp-gpt-math", dict(world_size=4, causal=False, seq_len=12, load_balancer="zigzag"), PASS),
    ("torch-cp-gpt-math", dict(world_size=2), FAIL),
    ("torch-cp-gpt-math", dict(world_size=2, load_balancer="none"), FAIL),
]


@pytest.mark.parametrize("case,fields,verdict", PINNED)
def test_cases_declare_the_pinned_verdicts(case, fields, verdict):
    assert expected_verdict(CheckConfig(case=case, **fields)) == verdict


# ------------------------------------------------------------------ on gloo ranks

def test_default_sdpa_causal_raises_in_forward_in_sharding_propagation(sp_check):
    # torch 2.13: CPU SDPA dispatches _scaled_dot_product_flash_attention_for_cpu on the DTensors
    # context_parallel made; no CP ring handler, no sharding strategy, and the decomposition
    # fallback cannot shard the causal form: NotImplementedError from sharding propagation
    res = sp_check(CheckConfig(case="torch-cp-gpt", world_size=2, steps=1))
    assert res.verdict == FAIL and res.crash_kind == "raised", res.reason
    assert {(e.kind, e.exc_type) for e in res.rank_errors} == {("raised", "NotImplementedError")}
    for e in res.rank_errors:
        frames = _frames(e.traceback)
        assert PROPAGATION_FRAME in frames[-1] and "propagate_op_sharding_non_cached" in frames[-1]
        assert any(CP_FRAME in f and "inner_fn" in f for f in frames)  # through CP's patched SDPA
        assert not any("_templated_ring_attention" in f for f in frames)  # the ring never runs


def test_math_sdpa_causal_raises_where_the_mask_meets_a_dtensor(sp_check):
    # the math kernel adds its plain causal mask to DTensor scores: RuntimeError raised from the
    # C++ dispatch under CP's patched SDPA (no ring either)
    res = sp_check(CheckConfig(case="torch-cp-gpt-math", world_size=2, steps=1))
    assert res.verdict == FAIL and res.crash_kind == "raised", res.reason
    assert {(e.kind, e.exc_type) for e in res.rank_errors} == {("raised", "RuntimeError")}
    for e in res.rank_errors:
        innermost = _frames(e.traceback)[-1]
        assert CP_FRAME in innermost and "inner_fn" in innermost


@pytest.mark.parametrize("world_size,load_balancer", [(2, "zigzag"), (3, "none")])
def test_math_sdpa_non_causal_even_shards_pass(sp_check, world_size, load_balancer):
    res = sp_check(CheckConfig(case="torch-cp-gpt-math", world_size=world_size, causal=False,
                               load_balancer=load_balancer, steps=2))
    assert res.verdict == PASS, res.reason


def test_math_sdpa_uneven_shards_desync(sp_check):
    # 10 tokens over 3 ranks (4/4/2): the patched SDPA's DTensor.from_local assumes even shards,
    # so the ranks all-gather different sizes (gloo aborts a rank); the announced collectives show it
    res = sp_check(CheckConfig(case="torch-cp-gpt-math", world_size=3, seq_len=10, causal=False, steps=1))
    assert res.verdict == FAIL and res.crash_kind == "desync", res.reason
    sizes = {e.collective.nbytes for e in res.rank_errors if e.collective is not None}
    assert len(sizes) == 2


def test_math_sdpa_empty_shard_raises_on_the_empty_rank(sp_check):
    # 6 tokens over 4 ranks (2/2/2/0): the rank with no tokens raises RuntimeError under CP's
    # patched SDPA (the math kernel's empty-query path meets a plain tensor), the others do not
    res = sp_check(CheckConfig(case="torch-cp-gpt-math", world_size=4, seq_len=6, causal=False, steps=1))
    assert res.verdict == FAIL and res.crash_kind == "raised", res.reason
    raised = [e for e in res.rank_errors if e.kind == "raised"]
    assert [(e.rank, e.exc_type) for e in raised] == [(3, "RuntimeError")]
    innermost = _frames(raised[0].traceback)[-1]
    assert CP_FRAME in innermost and "inner_fn" in innermost


@pytest.mark.exhaustive("about 35 s of DTensor's decomposition fallback; the fast tier runs torch-cp-gpt's other pins")
def test_default_sdpa_non_causal_raises_in_backward(sp_check):
    # the forward shards _scaled_dot_product_flash_attention_for_cpu by DTensor's decomposition
    # fallback (slowly: ~50 s on the 2-core CI machine, hence the timeout); its backward op has no
    # strategy and no decomposition: NotImplementedError from sharding propagation, in autograd
    res = sp_check(CheckConfig(case="torch-cp-gpt", world_size=2, causal=False, steps=1, timeout_s=400))
    assert res.verdict == FAIL and res.crash_kind == "raised", res.reason
    assert {(e.kind, e.exc_type) for e in res.rank_errors} == {("raised", "NotImplementedError")}
    for e in res.rank_errors:
        frames = _frames(e.traceback)
        assert PROPAGATION_FRAME in frames[-1] and "propagate_op_sharding_non_cached" in frames[-1]
        assert any("torch/autograd/graph.py" in f and "_engine_run_backward" in f for f in frames)
