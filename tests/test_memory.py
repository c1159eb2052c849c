"""Activation memory and communication volume of SP against Korthikanti et al. (sp_harness.checks.activation_memory).

The memory check passes for megatron-gpt-sp (each rank's layer saves exactly its adjusted
formula, norm-region activations 1/t of the TP twin's) and fails for the mutant that all-gathers
the sequence before the norms; the communication gate passes for SP and fails for that mutant,
whose numerics are exact (PASS): only these two checks kill it.
"""

from __future__ import annotations

import pytest

from sp_harness.capture.comm import CommRow
from sp_harness.checks import get_check, run_check
from sp_harness.checks.activation_memory import activation_gate, activation_report, adjusted_bytes, paper_bytes
from sp_harness.checks.activation_memory_rank import measure_reference_layer, memory_config
from sp_harness.compare.comm_volume import paper_check
from sp_harness.config.check_config import CheckConfig

MUTANT = "mutant-sp-full-sequence-norms"
MEM = dict(dtype="float32", seq_len=12, hidden=32, num_heads=4)


def test_paper_formulas_agree_at_one_rank():
    dims = dict(s=16, b=2, h=64, a=8)
    none = paper_bytes("none", **dims)
    assert paper_bytes("tp", t=1, **dims) == pytest.approx(none)
    assert paper_bytes("sp", t=1, **dims) == pytest.approx(none)
    assert paper_bytes("sp", t=4, **dims) == pytest.approx(none / 4)
    cfg = memory_config(CheckConfig(case="megatron-gpt-sp", world_size=1, **MEM))
    assert adjusted_bytes("sp", cfg) == adjusted_bytes("tp", cfg) == adjusted_bytes("none", cfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_layer_saves_exactly_the_adjusted_formula(dtype):
    cfg = memory_config(CheckConfig(case="megatron-gpt-sp", world_size=1, **dict(MEM, dtype=dtype)))
    assert cfg.ffn == 4 * cfg.hidden
    mem = measure_reference_layer(cfg)
    assert mem.activation_bytes == adjusted_bytes("none", cfg)
    assert mem.param_bytes > 0  # weights were saved too, and left out


def test_memory_check_passes_for_sp(sp_pool):
    report = activation_report(CheckConfig(case="megatron-gpt-sp", world_size=2, **MEM), sp_pool, tp_case="megatron-gpt-tp")
    ok, msg = activation_gate(report)
    assert ok, msg
    for row in report.rows:
        assert row.sp_bytes == row.sp_adjusted and row.tp_bytes == row.tp_adjusted
        assert row.norm_ratio == pytest.approx(0.5)
        assert row.sp_tp_ratio < 0.95


def test_memory_check_fails_for_full_sequence_mutant(sp_pool):
    report = activation_report(CheckConfig(case=MUTANT, world_size=2, **MEM), sp_pool, tp_case="megatron-gpt-tp")
    ok, msg = activation_gate(report)
    assert not ok
    assert "norm-region activations SP/TP = 1.000" in msg
    assert all(row.sp_tp_ratio == pytest.approx(1.0) for row in report.rows)


def test_comm_comparison_on_rows():
    def row(kind, phase, n):
        return CommRow(phase=phase, kind=kind, group="tp", count=1, bytes=n)

    tp_rows = [row("all_reduce", "forward", 100), row("all_reduce", "backward", 100)]
    sp_rows = [row("all_gather", "forward", 100), row("reduce_scatter", "forward", 100),
               row("all_gather", "backward", 100), row("reduce_scatter", "backward", 100)]
    assert paper_check(tp_rows, sp_rows, tp=2).matches
    assert not paper_check(tp_rows, sp_rows[:2], tp=2).matches
    # SP that only moves half the bytes is as wrong as one that moves double
    assert not paper_check(tp_rows, [row(r.kind, r.phase, 50) for r in sp_rows], tp=2).matches


def test_comm_check_fails_the_mutant_and_passes_sp(sp_pool):
    # the check runs the case and its TP baseline (megatron-gpt-tp) side by side and compares their
    # collectives only where both PASS (else n/a, "no figures"): SP's volume matches TP's, and the
    # mutant, numerically exact (PASS: only memory / comm can kill it), moves more
    comm = get_check("comm-vs-baseline")
    sp = run_check(comm, CheckConfig(case="megatron-gpt-sp", world_size=2), sp_pool)
    assert sp.passed is True, sp.detail
    mutant = run_check(comm, CheckConfig(case=MUTANT, world_size=2), sp_pool)
    assert mutant.passed is False and mutant.caught_by == "collective accounting", mutant.detail
    # uneven shards (6/5) are padded: the figures are reported, not judged
    uneven = run_check(comm, CheckConfig(case="megatron-gpt-sp", world_size=2, seq_len=11), sp_pool)
    assert uneven.passed is None and "uneven shards 6/5 are padded to 6 tokens" in uneven.detail, uneven.detail


def test_memory_check_applies_to_sp_cases_only(sp_pool):
    memory = get_check("activation-memory")
    assert run_check(memory, CheckConfig(case="megatron-gpt-tp", world_size=2), sp_pool).passed is None
    assert run_check(memory, CheckConfig(case="seed-mlp", world_size=2), sp_pool).passed is None
    assert run_check(memory, CheckConfig(case="megatron-gpt-sp", world_size=1), sp_pool).passed is None
    outcome = run_check(memory, CheckConfig(case="megatron-gpt-sp", world_size=2), sp_pool)  # float64, ffn 4h
    assert outcome.passed is True, outcome.detail
