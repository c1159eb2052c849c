"""Stage: capture -> gate. Activation memory of one transformer layer, against Korthikanti et al.

What is measured: per rank, the bytes autograd saves for backward while ONE transformer layer
(`blocks[0]` of the model) runs its forward, recorded with `torch.autograd.graph.saved_tensors_hooks`
(entered by a forward pre-hook on the layer, left by its forward hook). Each storage is counted
once (keyed by `untyped_storage().data_ptr()`, sized by `untyped_storage().nbytes()`, so a saved
view keeps its whole storage alive and is charged for it), and storages that belong to a
parameter are left out: they are weights, not activations. Every saved tensor is also labelled
with the innermost submodule that saved it, which gives the norm-region share on its own.

No parallelism is measured in-process on `reference.gpt.Block`; TP and TP+SP inside a real rank
job (`sp_harness.checks.memory:activation_rank`) on the case's sharded model (megatron-gpt-tp / -sp or a
mutant), with the tokens and shards the engine would hand it.

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

from dataclasses import dataclass, field

import torch
from torch import nn

from sp_harness.config.check_config import CheckConfig
from sp_harness.config.shards import chunk_sizes

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

NORM_REGION = ("norm1", "norm2")


# ------------------------------------------------------------------ measurement


@dataclass
class SavedRecord:
    region: str
    """Innermost submodule of the layer that saved it ('' for the layer itself)."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    param: bool


@dataclass
class LayerMemory:
    """What one layer saved for backward on one rank."""

    rank: int = 0
    records: list[SavedRecord] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if not r.param)

    @property
    def param_bytes(self) -> int:
        return sum(r.nbytes for r in self.records if r.param)

    def region_bytes(self, prefixes=NORM_REGION) -> int:
        return sum(r.nbytes for r in self.records if not r.param and r.region.split(".")[0] in prefixes)

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            if not r.param:
                out[r.region] = out.get(r.region, 0) + r.nbytes
        return out


class SavedTensorMeter:
    """Records the storages autograd saves while `layer` runs forward (parameters flagged)."""

    def __init__(self, layer: nn.Module, params_of: nn.Module | None = None):
        self.layer = layer
        self.result = LayerMemory()
        self._seen: set[int] = set()
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in (params_of or layer).parameters()}
        self._stack: list[str] = []
        self._ctx = None
        self._handles = []

    def _pack(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except Exception:  # tensors without storage (subclasses): not activations we can size
            return t
        key = storage.data_ptr()
        if key in self._seen:
            return t
        self._seen.add(key)
        region = self._stack[-1] if self._stack else ""
        self.result.records.append(SavedRecord(region=region, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                                               nbytes=storage.nbytes(), param=isinstance(t, nn.Parameter) or key in self._param_ptrs))
        return t

    def __enter__(self):
        def enter(_m, _args):
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()

        def leave(_m, _args, _out):
            self._ctx.__exit__(None, None, None)
            self._ctx = None

        self._handles.append(self.layer.register_forward_pre_hook(enter))
        self._handles.append(self.layer.register_forward_hook(leave))
        for name, sub in self.layer.named_modules():
            if not name:
                continue
            self._handles.append(sub.register_forward_pre_hook(self._push(name)))
            self._handles.append(sub.register_forward_hook(self._pop))
        return self

    def _push(self, name: str):
        def hook(_m, _args) -> None:
            self._stack.append(name)
        return hook

    def _pop(self, _m, _args, _out) -> None:  # a forward hook's return value would replace the output
        self._stack.pop()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


def find_layer(model: nn.Module) -> nn.Module:
    """The first transformer layer: `model.blocks[0]` (reference GPT, Megatron twin, DTensor GPT)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__} has no `blocks`: cannot find a transformer layer to measure")
    return blocks[0]


def memory_config(config: CheckConfig) -> CheckConfig:
    """The config the memory check measures: the case's defaults, ffn = 4h unless given, LayerNorm."""
    from sp_harness.config.case import get_case

    cfg = get_case(config.case).resolve(config)
    if config.ffn is None:
        cfg = cfg.replace(ffn=4 * cfg.hidden)
    return cfg


def measure_reference_layer(config: CheckConfig) -> LayerMemory:
    """No parallelism, in-process: `reference.gpt.Block` fed [b, s, h] in the run dtype."""
    from sp_harness.cases.common import gpt_config
    from sp_harness.reference.gpt import Block

    cfg = memory_config(config)
    block = Block(gpt_config(cfg)).to(cfg.torch_dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.dp * cfg.batch, cfg.seq_len, cfg.hidden, generator=gen, dtype=torch.float64)
    x = x.to(cfg.torch_dtype).requires_grad_(True)
    with SavedTensorMeter(block) as meter:
        y = block(x)
    y.float().sum().backward()
    return meter.result


def activation_rank(config: CheckConfig) -> LayerMemory:
    """Rank job: build the case's sharded model as the engine does, run one forward + backward on
    this rank's piece of a batch, and return what `blocks[0]` saved."""
    from sp_harness.config.case import as_batch
    from sp_harness.step.build import build
    from sp_harness.step.context import is_dtensor
    from sp_harness.step.inputs import call, rank_batch

    built = build(config)
    model = built.sharded.module
    batch = as_batch(built.case.make_batch(config, 0, torch.Generator().manual_seed(config.seed + 7919)))
    local = rank_batch(batch, built.sharded, built.ctx, config.torch_dtype)
    with SavedTensorMeter(find_layer(model), params_of=model) as meter:
        out = call(model, local.inputs, local.positional)
    if is_dtensor(out):
        out = out.to_local()
    out.float().sum().backward()
    meter.result.rank = built.ctx.rank
    return meter.result


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


def adjusted_terms(mode: str, config: CheckConfig, rank: int = 0) -> dict[str, float]:
    """Per-rank bytes our layer saves, term by term (see the module docstring)."""
    cfg = config
    s, b, h, a, f = cfg.seq_len, cfg.dp * cfg.batch if mode == "none" else cfg.batch, cfg.hidden, cfg.num_heads, cfg.ffn
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


def adjusted_norm_bytes(mode: str, config: CheckConfig, rank: int = 0) -> float:
    return float(adjusted_terms(mode, config, rank)["norms (inputs + mean/rstd)"])


# ------------------------------------------------------------------ report and gate


def _ratio(x: float, y: float) -> float:
    return x / y if y else float("nan") if x else 1.0


def activation_report(config: CheckConfig, runner=None, *, tp_case: str = "megatron-gpt-tp") -> dict:
    """Measure one layer of `config.case` (claimed TP+SP) and of its TP twin `tp_case` at the same
    config, per rank, next to the paper's and the adjusted formulas. JSON-able dict; see
    `activation_gate` for the verdict and `format_activation_report` for the table."""
    from sp_harness.config.case import get_case
    from sp_harness.launch.runner import default_manager

    cfg = memory_config(config)
    get_case(cfg.case).validate(cfg)
    runner = runner or default_manager()
    label = f"activation memory: case {cfg.case} [{cfg.short()}]"
    sp_mem: list[LayerMemory] = runner.run(cfg.world_size, "sp_harness.checks.memory:activation_rank", cfg,
                                           timeout_s=cfg.timeout_s, label=label)
    tp_cfg = cfg.replace(case=tp_case)
    tp_mem: list[LayerMemory] = runner.run(cfg.world_size, "sp_harness.checks.memory:activation_rank", tp_cfg,
                                           timeout_s=cfg.timeout_s, label=label + f" (TP twin {tp_case})")
    layernorm = cfg.norm == "layernorm"
    rows = []
    for rank in range(cfg.world_size):
        sp, tp = sp_mem[rank], tp_mem[rank]
        sp_adj, tp_adj = adjusted_bytes("sp", cfg, rank), adjusted_bytes("tp", cfg, rank)
        shards = cfg.seq_shards or chunk_sizes(cfg.seq_len, cfg.tp)
        rows.append({
            "rank": rank,
            "sp_bytes": sp.activation_bytes, "tp_bytes": tp.activation_bytes,
            "sp_adjusted": sp_adj if layernorm else None, "tp_adjusted": tp_adj if layernorm else None,
            "sp_vs_adjusted": _ratio(sp.activation_bytes, sp_adj) if layernorm else None,
            "tp_vs_adjusted": _ratio(tp.activation_bytes, tp_adj) if layernorm else None,
            "sp_tp_ratio": _ratio(sp.activation_bytes, tp.activation_bytes),
            "sp_tp_expected": _ratio(sp_adj, tp_adj),
            "norm_sp_bytes": sp.region_bytes(), "norm_tp_bytes": tp.region_bytes(),
            "norm_ratio": _ratio(sp.region_bytes(), tp.region_bytes()),
            "norm_ratio_expected": shards[rank % cfg.tp] / cfg.seq_len,
            "sp_regions": sp.by_region(), "tp_regions": tp.by_region(),
        })
    dims = dict(s=cfg.seq_len, b=cfg.batch, h=cfg.hidden, a=cfg.num_heads, t=cfg.tp)
    return {
        "case": cfg.case, "tp_case": tp_case, "config": cfg.short(), "dtype": cfg.dtype, "ffn": cfg.ffn,
        "tp": cfg.tp, "dims": dims, "layernorm": layernorm, "rows": rows,
        "paper_sp_bytes": paper_bytes("sp", **dims), "paper_tp_bytes": paper_bytes("tp", **dims),
        "paper_sp_tp_ratio": paper_bytes("sp", **dims) / paper_bytes("tp", **dims),
        "tolerance": TOLERANCE, "adjustments": ADJUSTMENTS,
    }


def activation_gate(report: dict, tol: float = TOLERANCE) -> tuple[bool, str]:
    """(ok, message): every rank's measured layer within `tol` of its adjusted formula (TP twin and
    SP case), and the SP norm-region bytes over the TP twin's equal to s_r/s within `tol`."""
    problems = []
    for row in report["rows"]:
        r = row["rank"]
        for key, what in (("sp_vs_adjusted", report["case"]), ("tp_vs_adjusted", report["tp_case"])):
            v = row[key]
            if v is not None and abs(v - 1) > tol:
                problems.append(f"rank {r}: {what} saves {v:.3f}x its adjusted formula")
        want, got = row["norm_ratio_expected"], row["norm_ratio"]
        if abs(got / want - 1) > tol if want else got != 0:
            problems.append(f"rank {r}: norm-region activations SP/TP = {got:.3f}, expected s_r/s = {want:.3f} "
                            f"(full-sequence activations kept around the norms?)")
    worst = max(report["rows"], key=lambda row: row["sp_tp_ratio"])
    head = (f"activation memory {report['case']} vs {report['tp_case']} [{report['config']}]: "
            f"SP/TP {worst['sp_tp_ratio']:.3f} (adjusted formula {worst['sp_tp_expected']:.3f}, "
            f"paper {report['paper_sp_tp_ratio']:.3f}), norm region {worst['norm_ratio']:.3f} (expected "
            f"{worst['norm_ratio_expected']:.3f})")
    if problems:
        return False, head + ": FAIL: " + "; ".join(problems[:4])
    return True, head + f": ok within {tol:.0%}"


def memory_gate(config: CheckConfig, runner=None) -> tuple[bool | None, str]:
    """The memory check of one config for `sp-harness check` and the mutant battery:
    (ok, message), or (None, why) where it does not apply (not a Megatron-family TP+SP case, or
    tp = 1 where SP and TP coincide)."""
    from sp_harness.config.case import get_case

    case = get_case(config.case)
    if "megatron" not in case.tags or not case.baseline:
        return None, f"no activation-memory model for {case.name} (Megatron-family TP+SP cases only)"
    if config.world_size // config.dp <= 1:
        return None, "tp = 1: SP and TP save the same activations"
    return activation_gate(activation_report(config, runner, tp_case=case.baseline))


def format_activation_report(report: dict) -> str:
    lines = [f"activation memory per layer, {report['case']} vs TP twin {report['tp_case']} [{report['config']}]",
             f"  {'rank':>4} {'TP meas B':>10} {'TP adj B':>10} {'ratio':>6} {'SP meas B':>10} {'SP adj B':>10} "
             f"{'ratio':>6} {'SP/TP':>6} {'expect':>6} {'norm SP/TP':>10} {'expect':>6}"]
    for row in report["rows"]:
        def f(x, w, p=0):
            return f"{'-':>{w}}" if x is None else f"{x:>{w}.{p}f}"
        lines.append(f"  {row['rank']:>4} {row['tp_bytes']:>10} {f(row['tp_adjusted'], 10)} {f(row['tp_vs_adjusted'], 6, 3)} "
                     f"{row['sp_bytes']:>10} {f(row['sp_adjusted'], 10)} {f(row['sp_vs_adjusted'], 6, 3)} "
                     f"{row['sp_tp_ratio']:>6.3f} {row['sp_tp_expected']:>6.3f} {row['norm_ratio']:>10.3f} "
                     f"{row['norm_ratio_expected']:>6.3f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ communication


def comm_gate(tp_rows: list[dict], sp_rows: list[dict], tp: int) -> tuple[bool, str]:
    """(ok, message): per step and rank, TP+SP moves the same activation bytes as TP (the paper's
    claim: each all-reduce becomes a reduce-scatter + all-gather of the same payload)."""
    from sp_harness.capture.comm import paper_check

    if tp <= 1:
        return True, "communication: tp = 1, no TP collectives to compare"
    fig = paper_check(tp_rows, sp_rows, tp=tp)
    ar, ag, rs = fig["tp_all_reduce"], fig["sp_all_gather"], fig["sp_reduce_scatter"]
    msg = (f"communication per step per rank (ring bytes): TP {fig['tp_ring_bytes']:.0f} "
           f"({ar['count']} all-reduce, payload {ar['bytes']} B) vs TP+SP {fig['sp_ring_bytes']:.0f} "
           f"({ag['count']} all-gather {ag['bytes']} B + {rs['count']} reduce-scatter {rs['bytes']} B)")
    if fig["sp_other_kinds"]:
        msg += f", SP also uses {fig['sp_other_kinds']}"
    if fig["matches"]:
        return True, msg + ": equal, as the paper says"
    ratio = fig["sp_ring_bytes"] / fig["tp_ring_bytes"] if fig["tp_ring_bytes"] else float("inf")
    return False, msg + f": NOT equal (SP/TP {ratio:.3f}; paper: each all-reduce = reduce-scatter + all-gather)"


__all__ = ["SavedTensorMeter", "LayerMemory", "activation_rank", "measure_reference_layer", "paper_bytes",
           "adjusted_terms", "adjusted_bytes", "activation_report", "activation_gate", "memory_gate", "format_activation_report",
           "comm_gate", "ADJUSTMENTS", "memory_config"]
