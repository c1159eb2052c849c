"""Stage: step. yunchang (USP: Ulysses x ring sequence parallelism) as a
system under test: its `LongContextAttention` at a Ulysses degree x ring degree, inside the
reference GPT, verified against the same GPT with plain attention on one device. This module is
the user's side: the Case factory `usp_case` (its validation, its expected verdict) and the
sharded factory `yunchang_shard`; the pieces it assembles live beside it.

    from sp_harness.cases.frameworks.yunchang import usp_case
    USP_2X2 = usp_case("yc-usp-2x2", ulysses_degree=2, ring_degree=2, ring_impl_type="zigzag")

- The reference is the project's GPT (`sp_harness.reference.gpt`) whose attention core is a
  submodule (`blocks.N.attn.core`: plain softmax attention on (B, S, heads, d), float64); the
  projections, norms, MLPs, embeddings and head are the reference's own, by the same names
  (`yunchang_model`).
- The sharded twin is the same model (the reference's weights, every param replicated) with
  each core replaced by yunchang's `LongContextAttention(ring_impl_type=..., attn_type=FA)` on
  the process groups yunchang's own `set_seq_parallel_pg(ulysses_degree, ring_degree, rank,
  world_size, use_ulysses_low)` makes (its process-global `PROCESS_GROUP`; cached per process
  and degrees, reinstalled for each job). The sequence is placed by yunchang's own
  `EXTRACT_FUNC_DICT[ring_impl_type]` (`yunchang_layout`): the case's `Layout.seq_order` mirrors
  it, and each rank checks that its own tokens are exactly what yunchang's extract function
  gives it.
- Grads: yunchang ships no grad sync (it is an attention layer). Every param is replicated over
  the SP group and each rank's loss covers its own tokens over the global count, so each grad is
  SUMMED over the SP group, as two all-reduces over yunchang's own groups (ULYSSES_PG, then
  RING_PG: together the SP group), then AVERAGED over DP.
- The attention LSE each rank's ring returns (`return_attn_probs=True`, which yunchang's layer
  accepts and discards) is recorded by a pass-through around `ring_attn_fn` and judged against
  the reference's (check kind `lse`): (B, heads of my Ulysses rank, my Ulysses group's tokens).
- CPU: yunchang's pure-torch attention types have no backward and no CPU path; its default FA
  path runs over `flash_attn_standin` (flash-attn 2.8's two kernels), installed by
  `yunchang_shims.cpu_shims` alone, only where the ranks run on the CPU. `usp_case(kernel=...)`
  picks what computes each block: 'exact' (torch ops, the default) or 'torch-flash' (torch's
  flash-attention kernels: FlashAttention-2 where a GPU is visible, the block handed to it and
  back, else aten's CPU flash kernel); `yc-usp-torch-flash` is `yc-usp` on the latter.
- yunchang's ring merge (`update_out_and_lse`) casts each block's output to float32 and its
  backward accumulates dq/dk/dv in float32: at float64 the attention cores are a float32 island
  (declared: `precision_islands`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import Case, Layout, Sharded, Unsupported
from sp_harness.cases.common import GPT_DEFAULTS, as_gpt, gpt_fields, known, sum_replicated_grads
from sp_harness.cases.frameworks.yunchang_layout import (
    default_ring_degree,
    degrees,
    extract_positions,
    grid_coords,
    seq_order,
    yunchang_groups,
)
from sp_harness.cases.frameworks.yunchang_model import CoreAttention, YunchangCore, build_reference
from sp_harness.cases.frameworks.yunchang_shims import cpu_shims
from sp_harness.config.check_config import CheckConfig

YUNCHANG_VERSION = "0.6.4"
"""The release this module is tested with (the `yunchang` extra pins it)."""

RING_IMPLS = ("basic", "zigzag", "strip")
"""yunchang's flash-attention ring implementations (`RING_IMPL_DICT` keys) this case runs."""
CAUSAL_ONLY = ("zigzag", "strip")
"""Ring implementations yunchang asserts causal for ("zigzag ring is meaningless for causal=False")."""
MAX_LAYERS = 64
"""Blocks whose attention core is declared a float32 island (more than any config here uses)."""
SYNC_GROUPS = ("ulysses", "ring")
"""The groups the correct grad sync sums over (both: the SP group)."""


def yunchang_shard(*, ring_impl_type: str = "zigzag", use_ulysses_low: bool = True, extract: str | None = None,
                   merge: Callable | None = None, forward_swaps: Mapping[str, Any] | None = None,
                   sync_groups: Sequence[str] = SYNC_GROUPS, kernel: str = "exact"):
    """The sharded factory of a `usp_case`. `extract`: the `EXTRACT_FUNC_DICT` key the input is
    placed by (None: `ring_impl_type`'s own, as yunchang's tests do). `merge`: a replacement for
    the ring's `update_out_and_lse` during forward (None: yunchang's). `forward_swaps`: any other
    names of the ring implementation's module replaced during forward (a mutant's).
    `sync_groups`: which of yunchang's groups the replicated grads are summed over (both: the SP
    group). `kernel`: what computes each block on CPU ranks (`flash_attn_standin.KERNELS`)."""
    swaps = {**({"update_out_and_lse": merge} if merge else {}), **(forward_swaps or {})}
    placement = extract or ring_impl_type

    def shard(reference: nn.Module, ctx) -> Sharded:
        from yunchang import EXTRACT_FUNC_DICT, LongContextAttention
        from yunchang.kernels import AttnType

        ctx.once("yunchang-cpu-shims", lambda: cpu_shims(ctx.device))
        from sp_harness.cases.frameworks import flash_attn_standin

        flash_attn_standin.use_kernel(kernel)  # every job sets it: cases share a warm process
        cfg = ctx.config
        ulysses, ring = degrees(cfg)
        refuse_gloo_ring_of_one(cfg, ring, dist.get_backend())
        yunchang_groups(ctx, ulysses, ring, use_ulysses_low)
        from yunchang.globals import PROCESS_GROUP

        pieces = extract_positions(placement, cfg.seq_len, ulysses, ring, use_ulysses_low)
        theirs = EXTRACT_FUNC_DICT[placement](torch.arange(cfg.seq_len).view(1, -1, 1), ctx.tp_rank,
                                              world_size=ctx.tp, rd=ring, ud=ulysses).reshape(-1)
        if not torch.equal(theirs, pieces[ctx.tp_rank]):
            raise RuntimeError(f"yunchang's {placement}_extract_local gives SP rank {ctx.tp_rank} positions "
                               f"{theirs.tolist()}, the case's placement {pieces[ctx.tp_rank].tolist()}")
        r, u = grid_coords(ctx.tp_rank, ulysses, ring, use_ulysses_low)
        members = [t for t in range(ctx.tp) if grid_coords(t, ulysses, ring, use_ulysses_low)[0] == r]
        members.sort(key=lambda t: grid_coords(t, ulysses, ring, use_ulysses_low)[1])
        positions = torch.cat([pieces[t] for t in members])  # the all-to-all's order: member by member
        heads_here = cfg.num_heads // ulysses
        heads = torch.arange(u * heads_here, (u + 1) * heads_here)
        for block in as_gpt(reference).blocks:
            usp = LongContextAttention(ring_impl_type=ring_impl_type, attn_type=AttnType.FA)
            attn = block.attn
            assert isinstance(attn, CoreAttention)  # build_reference's
            attn.core = YunchangCore(usp, attn.causal, (heads, positions), swaps=swaps)
        groups = {"ulysses": PROCESS_GROUP.ULYSSES_PG, "ring": PROCESS_GROUP.RING_PG}
        sync = [groups[g] for g in sync_groups]

        def sync_grads() -> None:
            # SUM over the SP group = over the Ulysses group, then the ring
            sum_replicated_grads(reference, ctx, over=sync)

        layout = Layout(seq_dim=1, batch_dim=0, seq_order=seq_order(placement, ulysses, ring, use_ulysses_low))
        return Sharded(module=reference, input_layout=layout, output_layout=layout, replicated=("*",),
                       sync_grads=sync_grads)

    return shard


def refuse_gloo_ring_of_one(cfg: CheckConfig, ring: int, backend: str) -> None:
    """Unsupported for a ring of one rank with a backward on gloo. The driver knows the backend
    only where there is no GPU (gloo); ranks on a GPU machine may be gloo's too (the CLI's pools)
    and say so from `dist.get_backend()`."""
    if ring == 1 and not cfg.forward_only and backend == "gloo":
        raise Unsupported("ring_degree 1 on gloo: yunchang's ring backward still sends dk/dv around a one-rank "
                          "ring (batch_isend_irecv to itself), which gloo cannot (its pair to itself is never "
                          "connected); forward-only runs, or NCCL")


def _import_yunchang() -> None:
    """The case's per-process setup: yunchang's modules imported before any job's clock."""
    import yunchang  # noqa: F401


@dataclasses.dataclass(frozen=True, kw_only=True)
class YunchangCase(Case):
    """A Case whose ring_degree default depends on the run's SP size (and a fixed degree)."""

    fixed_ring_degree: int | None = None
    fixed_ulysses_degree: int | None = None

    def resolve(self, config: CheckConfig) -> CheckConfig:
        if config.ring_degree is None and config.world_size and config.dp:
            sp = config.world_size // config.dp
            if self.fixed_ring_degree:
                ring = self.fixed_ring_degree
            elif self.fixed_ulysses_degree and sp % self.fixed_ulysses_degree == 0:
                ring = sp // self.fixed_ulysses_degree
            else:
                ring = default_ring_degree(sp)
            config = config.replace(ring_degree=ring)
        return super().resolve(config)


def expect_float32_alias(config: CheckConfig) -> str:
    """FAIL at float32, PASS otherwise: yunchang's ring backward starts its accumulators with
    `dq = dq_buffer.to(torch.float32)`, which for a float32 `q` is the kernel's output buffer itself,
    overwritten by the next ring step (docs/frameworks/yunchang.md, finding 1). Pinned, so that a
    fixed yunchang shows as an unexpected PASS, and a benchmark of cost per verified example
    (sp_harness.suites.bench_realistic.runnable) does not time a known failure."""
    return "FAIL" if config.dtype == "float32" else "PASS"


def usp_case(name: str, *, ulysses_degree: int | None = None, ring_degree: int | None = None,
             ring_impl_type: str = "zigzag", use_ulysses_low: bool = True, extract: str | None = None,
             merge: Callable | None = None, forward_swaps: Mapping[str, Any] | None = None,
             sync_groups: Sequence[str] = SYNC_GROUPS, kernel: str = "exact", **case_fields: Any) -> Case:
    """A `Case` checking yunchang's `LongContextAttention` (USP) at `ulysses_degree` x
    `ring_degree` (None: whatever the run has; ring degree 2 where 2 divides the SP size) with
    `ring_impl_type` ('zigzag', 'basic', 'strip') and yunchang's group layout `use_ulysses_low`,
    inside the reference GPT, against the same GPT with plain attention. `extract`, `merge`,
    `forward_swaps`, `sync_groups`, `kernel`: as `yunchang_shard`'s. `case_fields`: any other `Case` field
    (defaults, tags, examples, isolation, ...)."""
    from sp_harness.cases.frameworks.flash_attn_standin import KERNELS

    if ring_impl_type not in RING_IMPLS:
        raise ValueError(f"usp_case({name!r}): ring_impl_type {ring_impl_type!r}: one of {RING_IMPLS}")
    if kernel not in KERNELS:
        raise ValueError(f"usp_case({name!r}): kernel {kernel!r}: one of {KERNELS}")
    placement = extract or ring_impl_type

    def validate(cfg: CheckConfig) -> None:
        ulysses, ring = degrees(cfg)
        sp = cfg.tp
        if cfg.layout not in (None, "bsh"):
            raise Unsupported(f"yunchang's LongContextAttention takes (batch, seq, heads, dim): layout {cfg.layout!r}")
        if sp % ring:
            raise Unsupported(f"ring_degree {ring} does not divide sp {sp} (yunchang: sp = ulysses x ring)")
        for what, want, got in (("ulysses_degree", ulysses_degree, ulysses), ("ring_degree", ring_degree, ring)):
            if want is not None and want != got:
                raise Unsupported(f"{name} is yunchang at {what} {want}; this run has {what} {got} "
                                  f"(sp {sp} = ulysses {ulysses} x ring {ring})")
        if cfg.seq_shards is not None:
            raise Unsupported("yunchang's extract functions split the sequence evenly; no explicit seq_shards")
        heads = known(cfg.num_heads, "num_heads")
        for what, n in (("num_heads", heads), ("num_kv_heads", cfg.num_kv_heads or heads)):
            if n % ulysses:
                raise Unsupported(f"yunchang's all-to-all splits heads evenly: {what} ({n}) % ulysses_degree "
                                  f"({ulysses}) != 0")
        seq_len = known(cfg.seq_len, "seq_len")
        if seq_len % sp:
            raise Unsupported(f"yunchang's all-to-all and {placement}_extract_local need equal shards: seq_len "
                              f"({seq_len}) % sp ({sp}) != 0")
        if placement == "zigzag" and seq_len % (2 * ring):
            raise Unsupported(f"yunchang's zigzag_extract_local cuts 2 x ring_degree equal chunks: seq_len "
                              f"({seq_len}) % {2 * ring} != 0")
        if placement == "strip" and seq_len % ring:
            raise Unsupported(f"yunchang's stripe_extract_local needs seq_len ({seq_len}) % ring_degree "
                              f"({ring}) == 0")
        if not torch.cuda.is_available():  # then the ranks are gloo's; on a GPU machine they say (shard)
            refuse_gloo_ring_of_one(cfg, ring, "gloo")
        if ring_impl_type in CAUSAL_ONLY and cfg.causal is False:
            raise Unsupported(f"yunchang's {ring_impl_type} ring is causal only (it asserts causal=True)")
        if kernel == "torch-flash" and torch.cuda.is_available():
            hidden = known(cfg.hidden, "hidden")
            if cfg.dtype not in ("bfloat16", "float16"):
                raise Unsupported(f"torch's CUDA flash-attention kernel takes float16 / bfloat16, not {cfg.dtype}")
            if hidden % heads or (hidden // heads) % 8:
                raise Unsupported(f"torch's CUDA flash-attention kernel needs a head dim divisible by 8: hidden "
                                  f"({hidden}) / num_heads ({heads})")

    case_fields.setdefault("setup", _import_yunchang)
    defaults = {**GPT_DEFAULTS, "causal": True, **case_fields.pop("defaults", {})}
    tags = ("yunchang", "framework", "usp", *case_fields.pop("tags", ()))
    # the GPT case's fields, its reference with each attention's core a submodule, `case_fields` over them
    fields = {**gpt_fields(defaults, positions=True), "build_reference": build_reference,
              "expect": expect_float32_alias, **case_fields}
    desc = (f"yunchang {YUNCHANG_VERSION} LongContextAttention (USP), ring_impl_type={ring_impl_type!r}, "
            f"{'' if kernel == 'exact' else f'kernel={kernel!r}, '}"
            f"ulysses x ring = {ulysses_degree or 'sp/R'} x {ring_degree or 'R'}"
            f"{'' if use_ulysses_low else ', use_ulysses_low=False'}")
    return YunchangCase(
        name=name, description=desc, validate=validate,
        shard=yunchang_shard(ring_impl_type=ring_impl_type, use_ulysses_low=use_ulysses_low, extract=extract,
                             merge=merge, sync_groups=sync_groups, forward_swaps=forward_swaps, kernel=kernel),
        precision_islands={f"blocks.{i}.attn.core": "float32" for i in range(MAX_LAYERS)},
        fixed_ring_degree=ring_degree, fixed_ulysses_degree=ulysses_degree, tags=tags, **fields)


__all__ = ["CAUSAL_ONLY", "MAX_LAYERS", "RING_IMPLS", "SYNC_GROUPS", "YUNCHANG_VERSION", "YunchangCase",
           "expect_float32_alias", "refuse_gloo_ring_of_one", "usp_case", "yunchang_shard"]
