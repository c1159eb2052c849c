"""Stage: checks. Activation memory of one transformer layer, against Korthikanti et al.

What is measured (sp_harness.capture.saved_activations says how): per rank, the bytes autograd
saves for backward while ONE transformer layer (`blocks[0]` of the model) runs its forward, each
storage counted once, parameters left out (weights, not activations), each saved tensor labelled
with the innermost submodule that saved it (which gives the norm-region share on its own).
Where (sp_harness.checks.activation_memory_rank): no parallelism in-process on the reference's
layer, TP and TP+SP in a real rank job on the case's sharded model and its TP baseline
(`Case.baseline`).

The paper's per-layer formulas (arXiv 2205.05198, section 4; bytes, 16-bit activations, 1-byte
dropout masks, ffn = 4h, s = sequence, b = micro-batch, h = hidden, a = heads, t = TP degree):

    no parallelism   sbh (34 + 5as/h)
    TP               sbh (10 + 24/t + 5as/(ht))
    TP + SP          sbh/t (34 + 5as/h)

Their terms (per layer, 2-byte units except the 1-byte masks):
    LayerNorm inputs 2 x 2sbh | QKV input 2sbh | Q, K 4sbh | softmax output 2as^2b |
    softmax dropout mask as^2b | dropout output (attention over V's input) 2as^2b | V 2sbh |
    out-proj input 2sbh | attention dropout mask sbh | fc1 input 2sbh | GELU input 8sbh |
    fc2 input 8sbh | MLP dropout mask sbh

ADJUSTED to what our layer actually saves (`ADJUSTMENTS`, one line each, also in the table):
  1. element size e (4 bytes float32, 2 bfloat16, 8 float64) instead of 2 bytes;
  2. no dropout: the two sbh masks, the as^2b softmax-dropout mask and the 2as^2b dropout output
     are gone; attention over V saves the softmax output itself (same storage, counted once);
  3. ffn = f (4h in the paper): GELU input and fc2 input are sbf each (8sbh = 2 x 4h in 16-bit);
  4. LayerNorm also saves its per-token mean and rstd: 2sb elements per norm (the paper omits them);
  5. the causal mask of masked_fill is saved: s^2 bytes (bool), once per layer (the paper's fused
     kernel keeps none);
  6. under SP our `gather_from_sp` hands the all-gathered full sequence to the column-parallel
     linears, which save it: the QKV and fc1 inputs cost sbh elements each, not sbh/t. Megatron
     saves the shard and all-gathers again in backward (paper section 4.2.2), which is where the
     paper's (34/t) comes from for those two terms. This is the one place our SP saves less than
     the paper says it could: a finding about cases/megatron, not an error of the measurement.

Per rank with local sizes (heads a_r, ffn columns f_r, sequence shard s_r under SP, d = h/a,
hp_r = a_r d; TP-only and no-parallel norms see the full s), in elements of size e:

    norms         2 (s_n b h) + 4 s_n b           s_n = s_r (SP) or s (TP, none)
    column input  2 s b h                         QKV input + fc1 input (full sequence)
    attention     2 s b hp_r (Q, K) + s b hp_r (V) + s b hp_r (out-proj input) + a_r s^2 b
    MLP           2 s b f_r (GELU input, fc2 input)
    + s^2 bytes (mask)

With even splits and f = 4h: none = sbh(16) + as^2b + 4sb; TP = sbh(4 + 12/t) + as^2b/t + 4sb;
SP = sbh(2 + 14/t) + as^2b/t + 4sb/t (elements), against the paper-adjusted SP sbh(16/t) + ...

The gate (`activation_gate`): every measured layer within 5% of its adjusted formula, and the
norm-region bytes of the SP case over those of its TP twin equal to s_r/s (1/t for even shards)
within 5%: an implementation that keeps full-sequence activations around its norms fails it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from sp_harness.capture.saved_activations import LayerMemory
from sp_harness.checks.activation_memory_rank import activation_rank, memory_config
from sp_harness.checks.base import Outcome
from sp_harness.config.case import Case
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case
from sp_harness.config.shards import chunk_sizes
from sp_harness.launch.runner import Runner

TOLERANCE = 0.05

ADJUSTMENTS = [
    "element size e bytes (float32 4, bfloat16 2, float64 8) instead of the paper's 2",
    "no dropout: drop the 2 sbh-byte masks, the as^2b mask and the 2as^2b dropout output",
    "ffn f instead of 4h: GELU input + fc2 input = 2sbf elements (paper 16sbh bytes)",
    "LayerNorm saves mean + rstd: +2sb elements per norm (paper omits)",
    "causal mask saved by masked_fill: +s^2 bytes (bool) per layer (paper: fused kernel)",
    "SP: column-parallel linears save the all-gathered input (QKV, fc1): 2sbh, not 2sbh/t "
    "(Megatron saves the shard and re-gathers in backward)",
]


# ------------------------------------------------------------------ formulas


def paper_bytes(mode: str, *, s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """Korthikanti et al. per-layer activation bytes (16-bit, dropout, ffn = 4h)."""
    sbh = s * b * h
    if mode == "none":
        return sbh * (34 + 5 * a * s / h)
    if mode == "tp":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "sp":
        return sbh / t * (34 + 5 * a * s / h)
    raise ValueError(f"mode must be none/tp/sp, got {mode!r}")


def _shape(cfg: CheckConfig) -> tuple[int, int, int, int, int]:
    """(seq_len, batch, hidden, num_heads, ffn) of a resolved config (`memory_config` fills them)."""
    assert (cfg.seq_len is not None and cfg.batch is not None and cfg.hidden is not None
            and cfg.num_heads is not None and cfg.ffn is not None), \
        f"activation memory of an unresolved config [{cfg.short()}] (memory_config fills the shape)"
    return cfg.seq_len, cfg.batch, cfg.hidden, cfg.num_heads, cfg.ffn


def adjusted_terms(mode: str, config: CheckConfig, rank: int = 0) -> dict[str, float]:
    """Per-rank bytes our layer saves, term by term (see the module docstring)."""
    cfg = config
    seq_len, batch, hidden, num_heads, ffn = _shape(cfg)
    s, b, h, a, f = seq_len, cfg.dp * batch if mode == "none" else batch, hidden, num_heads, ffn
    e = torch.empty((), dtype=cfg.torch_dtype).element_size()
    t = 1 if mode == "none" else cfg.tp
    tr = rank % t
    a_r = chunk_sizes(a, t)[tr]
    f_r = chunk_sizes(f, t)[tr]
    hp_r = a_r * (h // a)
    if mode == "sp":
        shards = cfg.seq_shards or chunk_sizes(s, t)
        s_n = shards[tr]
    else:
        s_n = s
    return {
        "norms (inputs + mean/rstd)": e * (2 * s_n * b * h + 4 * s_n * b),
        "column-parallel inputs (QKV, fc1)": e * 2 * s * b * h,
        "Q, K, V, out-proj input": e * 4 * s * b * hp_r,
        "softmax output": e * a_r * s * s * b,
        "GELU input, fc2 input": e * 2 * s * b * f_r,
        "causal mask (bool)": s * s,
    }


def adjusted_bytes(mode: str, config: CheckConfig, rank: int = 0) -> float:
    return float(sum(adjusted_terms(mode, config, rank).values()))


# ------------------------------------------------------------------ report and gate


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("nan") if x else 1.0


@dataclass(kw_only=True, frozen=True)
class MemoryRow:
    """One rank's layer: measured, the adjusted formula, and the SP/TP ratios."""

    rank: int
    sp_bytes: int
    tp_bytes: int
    sp_adjusted: float | None
    """The adjusted formula (LayerNorm models only; None for RMSNorm)."""
    tp_adjusted: float | None
    sp_vs_adjusted: float | None
    tp_vs_adjusted: float | None
    sp_tp_ratio: float
    sp_tp_expected: float
    norm_sp_bytes: int
    norm_tp_bytes: int
    norm_ratio: float
    norm_ratio_expected: float
    """s_r / s: this rank's share of the sequence."""
    sp_regions: dict[str, int]
    tp_regions: dict[str, int]


@dataclass(kw_only=True, frozen=True)
class MemoryReport:
    """One layer of an SP case and of its TP baseline at the same config, per rank."""

    case: str
    tp_case: str
    config: str
    dtype: str
    ffn: int
    tp: int
    dims: dict[str, int]
    layernorm: bool
    rows: tuple[MemoryRow, ...]
    paper_sp_bytes: float
    paper_tp_bytes: float
    paper_sp_tp_ratio: float
    tolerance: float = TOLERANCE
    adjustments: tuple[str, ...] = tuple(ADJUSTMENTS)

    def to_json(self) -> dict:
        return asdict(self)


def _row(rank: int, sp: LayerMemory, tp: LayerMemory, cfg: CheckConfig) -> MemoryRow:
    layernorm = cfg.norm == "layernorm"
    sp_adj, tp_adj = adjusted_bytes("sp", cfg, rank), adjusted_bytes("tp", cfg, rank)
    seq_len = _shape(cfg)[0]
    shards = cfg.seq_shards or chunk_sizes(seq_len, cfg.tp)
    return MemoryRow(
        rank=rank, sp_bytes=sp.activation_bytes, tp_bytes=tp.activation_bytes,
        sp_adjusted=sp_adj if layernorm else None, tp_adjusted=tp_adj if layernorm else None,
        sp_vs_adjusted=_ratio(sp.activation_bytes, sp_adj) if layernorm else None,
        tp_vs_adjusted=_ratio(tp.activation_bytes, tp_adj) if layernorm else None,
        sp_tp_ratio=_ratio(sp.activation_bytes, tp.activation_bytes), sp_tp_expected=_ratio(sp_adj, tp_adj),
        norm_sp_bytes=sp.region_bytes(), norm_tp_bytes=tp.region_bytes(),
        norm_ratio=_ratio(sp.region_bytes(), tp.region_bytes()), norm_ratio_expected=shards[rank % cfg.tp] / seq_len,
        sp_regions=sp.by_region(), tp_regions=tp.by_region())


def activation_report(config: CheckConfig, runner: Runner, *, tp_case: str) -> MemoryReport:
    """Measure one layer of `config.case` (claimed TP+SP) and of its TP twin `tp_case` at the same
    config, per rank, next to the paper's and the adjusted formulas; see `activation_gate` for the
    verdict."""
    cfg = memory_config(config)
    get_case(cfg.case).validate(cfg)
    label = f"activation memory: case {cfg.case} [{cfg.short()}]"
    job = activation_rank
    assert cfg.timeout_s is not None, "memory_config resolves timeout_s"
    sp_mem: list[LayerMemory] = runner.run(cfg.world_size, job, cfg, timeout_s=cfg.timeout_s, label=label,
                                           case=cfg.case)
    tp_mem: list[LayerMemory] = runner.run(cfg.world_size, job, cfg.replace(case=tp_case), timeout_s=cfg.timeout_s,
                                           label=label + f" (TP twin {tp_case})", case=tp_case)
    seq_len, batch, hidden, num_heads, ffn = _shape(cfg)
    assert cfg.dtype is not None, "memory_config resolves the dtype"
    dims = dict(s=seq_len, b=batch, h=hidden, a=num_heads, t=cfg.tp)
    return MemoryReport(
        case=cfg.case, tp_case=tp_case, config=cfg.short(), dtype=cfg.dtype, ffn=ffn, tp=cfg.tp, dims=dims,
        layernorm=cfg.norm == "layernorm",
        rows=tuple(_row(r, sp_mem[r], tp_mem[r], cfg) for r in range(cfg.world_size)),
        paper_sp_bytes=paper_bytes("sp", **dims), paper_tp_bytes=paper_bytes("tp", **dims),
        paper_sp_tp_ratio=paper_bytes("sp", **dims) / paper_bytes("tp", **dims))


def activation_gate(report: MemoryReport, tol: float = TOLERANCE) -> tuple[bool, str]:
    """(ok, message): every rank's measured layer within `tol` of its adjusted formula (TP twin and
    SP case), and the SP norm-region bytes over the TP twin's equal to s_r/s within `tol`."""
    problems = []
    for row in report.rows:
        for v, what in ((row.sp_vs_adjusted, report.case), (row.tp_vs_adjusted, report.tp_case)):
            if v is not None and abs(v - 1) > tol:
                problems.append(f"rank {row.rank}: {what} saves {v:.3f}x its adjusted formula")
        want, got = row.norm_ratio_expected, row.norm_ratio
        if abs(got / want - 1) > tol if want else got != 0:
            problems.append(f"rank {row.rank}: norm-region activations SP/TP = {got:.3f}, expected s_r/s = {want:.3f} "
                            f"(full-sequence activations kept around the norms?)")
    worst = max(report.rows, key=lambda row: row.sp_tp_ratio)
    head = (f"activation memory {report.case} vs {report.tp_case} [{report.config}]: "
            f"SP/TP {worst.sp_tp_ratio:.3f} (adjusted formula {worst.sp_tp_expected:.3f}, "
            f"paper {report.paper_sp_tp_ratio:.3f}), norm region {worst.norm_ratio:.3f} (expected "
            f"{worst.norm_ratio_expected:.3f})")
    if problems:
        return False, head + ": FAIL: " + "; ".join(problems[:4])
    return True, head + f": ok within {tol:.0%}"


# ------------------------------------------------------------------ the check


class ActivationMemory:
    """Saved activations of one layer, SP case vs its TP baseline and the paper's formulas."""

    name = "activation-memory"
    label = "activation memory"

    def applies(self, case: Case, config: CheckConfig) -> str | None:
        # the formulas model the reference GPT block; a case without a TP baseline has no twin
        if "megatron" not in case.tags or not case.baseline:
            return f"no activation-memory model for {case.name} (Megatron-family SP cases with a TP baseline)"
        if config.tp <= 1:
            return "tp = 1: SP and TP save the same activations"
        return None

    def run(self, config: CheckConfig, runner: Runner) -> Outcome:
        case = get_case(config.case)
        report = activation_report(config, runner, tp_case=case.baseline)
        ok, message = activation_gate(report)
        return Outcome(check=self.name, status="pass" if ok else "fail", caught_by="" if ok else self.label,
                       detail=message, repro=config.repro() + " --memory", figures=report)

    def render(self, outcome: Outcome) -> str:
        return outcome.detail


CHECK = ActivationMemory()
