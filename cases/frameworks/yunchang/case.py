"""Stage: step. yunchang (USP: Ulysses x ring sequence parallelism) as a
system under test: its `LongContextAttention` at a Ulysses degree x ring degree (`usp_case`), or
its `UlyssesAttention` over the SP group (`ulysses_case`), inside the user's model (or the
reference GPT), verified against the same model with exact attention on one device. This module
is the user's side: the Case factories (their validation, their expected verdicts) and the
sharded factory `yunchang_shard`; the pieces it assembles live beside it.
    from sp_harness.cases.frameworks.yunchang.case import usp_case
    USP_2X2 = usp_case("yc-usp-2x2", ulysses_degree=2, ring_degree=2, ring_impl_type="zigzag")

- The reference is `model(config, attention)` (`yunchang_model.ModelFactory`; None: the
  project's GPT with each attention's core a submodule, `blocks.N.attn.core`) with every core
  exact attention on (B, S, heads, d) (`ReferenceAttention`), float64.
- `attn_type`: yunchang's `AttnType` value. 'fa' runs everywhere (the stand-in on the CPU);
  'torch_math' runs forward only (yunchang has no backward for torch types) and only in
  LongContextAttention; the rest have GPU-only kernels: UNSUPPORTED before any rank starts.
- The sharded twin is the same model (the reference's weights, every param replicated) with
  each core replaced by yunchang's `UlyssesAttention(sp group, attn_type)`, or its
  `LongContextAttention(ring_impl_type=..., attn_type)` on
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
from sp_harness.cases.common import GPT_DEFAULTS, gpt_fields, known, sum_replicated_grads, with_defaults
from sp_harness.cases.frameworks.deepspeed.loss import gpt_loss_fields, loss_limits
from sp_harness.cases.frameworks.releases import installed_release, require
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.yunchang.attn_types import (
    CPU_ATTN_TYPES,
    GPU_ONLY_ATTN_TYPES,
    NO_BACKWARD_ATTN_TYPES,
    attn_type_of,
    refuse_on_cpu_tensors,
    validate_attn_type,
)
from sp_harness.cases.frameworks.yunchang.layout import (
    default_ring_degree,
    degrees,
    extract_positions,
    grid_coords,
    seq_order,
    yunchang_groups,
)
from sp_harness.cases.frameworks.yunchang.model import (
    ModelFactory,
    ReferenceAttention,
    YunchangCore,
    build_reference,
    core_names,
)
from sp_harness.cases.frameworks.yunchang.shims import cpu_shims, import_yunchang, ulysses_layer
from sp_harness.config.check_config import CheckConfig

YUNCHANG_VERSION = "0.6.4"
"""The release this module is tested with (the `yunchang` extra pins it; the supported range:
yunchang_compat.RELEASES)."""
COMPAT = "sp_harness.cases.frameworks.yunchang.compat"
"""The package's releases module (`RELEASES`, `missing()`): asked by each case's validate."""


def _release() -> str:
    """The installed yunchang release (its metadata: no import), else the pinned one: what a
    case's description names."""
    return installed_release("yunchang") or YUNCHANG_VERSION


RING_IMPLS = ("basic", "zigzag", "strip")
"""yunchang's flash-attention ring implementations (`RING_IMPL_DICT` keys) this case runs."""
CAUSAL_ONLY = ("zigzag", "strip")
"""Ring implementations yunchang asserts causal for ("zigzag ring is meaningless for causal=False")."""
MAX_LAYERS = 64
"""Blocks whose attention core is declared a float32 island (more than any config here uses)."""
SYNC_GROUPS = ("ulysses", "ring")
"""The groups the correct grad sync sums over (both: the SP group)."""
LAYERS = ("usp", "ulysses")
"""yunchang's layers a case runs: 'usp' (`LongContextAttention`), 'ulysses' (`UlyssesAttention`)."""
def yunchang_shard(*, ring_impl_type: str = "zigzag", use_ulysses_low: bool = True, extract: str | None = None,
                   merge: Callable | None = None, forward_swaps: Mapping[str, Any] | None = None,
                   sync_groups: Sequence[str] = SYNC_GROUPS, kernel: str = "exact", layer: str = "usp",
                   attn_type: str = "fa", backward_swaps: Mapping[str, Any] | None = None,
                   set_pg: Callable | None = None):
    """The sharded factory of a `usp_case` or `ulysses_case`: the model handed in (the reference
    factory's, loaded with its weights) with each `ReferenceAttention` core replaced by yunchang's
    `layer` ('usp': `LongContextAttention(ring_impl_type, attn_type)` on yunchang's own groups;
    'ulysses': `UlyssesAttention(sp group, attn_type=attn_type)`). `extract`: the
    `EXTRACT_FUNC_DICT` key the input is placed by (None: `ring_impl_type`'s own, as yunchang's
    tests do; 'basic' for Ulysses). `merge`: a replacement for the ring's `update_out_and_lse`
    during forward (None: yunchang's). `forward_swaps`: other names replaced during the forward
    (of the ring implementation's module; of `yunchang.ulysses.attn_layer` for Ulysses);
    `backward_swaps`: names of the ring implementation's module replaced during the ring's
    backward (a mutant's). `sync_groups`: which of yunchang's groups the replicated grads are
    summed over (both: the SP group). `kernel`: what computes each block on CPU ranks
    (`flash_attn_standin.KERNELS`). `set_pg`: a replacement for yunchang's `set_seq_parallel_pg`
    (a mutant's; the input then placed by SP rank, unchecked against yunchang's extract)."""
    if layer not in LAYERS:
        raise ValueError(f"yunchang_shard: layer {layer!r}: one of {LAYERS}")
    swaps = {**({"update_out_and_lse": merge} if merge else {}), **(forward_swaps or {})}
    ulysses_only = layer == "ulysses"
    placement = extract or ("basic" if ulysses_only else ring_impl_type)

    def shard(reference: nn.Module, ctx) -> Sharded:
        import_yunchang()  # the case's setup has, unless a user's case replaced it
        from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, UlyssesAttention

        ctx.once("yunchang-cpu-shims", lambda: cpu_shims(ctx.device))
        from sp_harness.cases.frameworks import flash_attn_standin

        flash_attn_standin.use_kernel(kernel)  # every job sets it: cases share a warm process
        cfg = ctx.config
        kind = attn_type_of(attn_type)
        refuse_on_cpu_tensors(attn_type, ctx.device)
        if ulysses_only:
            ulysses, ring, low = ctx.tp, 1, True
            groups = {"ulysses": ctx.tp_group}
        else:
            ulysses, ring = degrees(cfg)
            refuse_gloo_ring_of_one(cfg, ring, dist.get_backend())
            yunchang_groups(ctx, ulysses, ring, use_ulysses_low, set_pg)
            from yunchang.globals import PROCESS_GROUP

            low = use_ulysses_low
            groups = {"ulysses": PROCESS_GROUP.ULYSSES_PG, "ring": PROCESS_GROUP.RING_PG}
        pieces = extract_positions(placement, cfg.seq_len, ulysses, ring, low)
        theirs = EXTRACT_FUNC_DICT[placement](torch.arange(cfg.seq_len).view(1, -1, 1), ctx.tp_rank,
                                              world_size=ctx.tp, rd=ring, ud=ulysses).reshape(-1)
        if set_pg is None and not torch.equal(theirs, pieces[ctx.tp_rank]):
            raise RuntimeError(f"yunchang's {placement}_extract_local gives SP rank {ctx.tp_rank} positions "
                               f"{theirs.tolist()}, the case's placement {pieces[ctx.tp_rank].tolist()}")
        r, u = grid_coords(ctx.tp_rank, ulysses, ring, low)
        members = [t for t in range(ctx.tp) if grid_coords(t, ulysses, ring, low)[0] == r]
        members.sort(key=lambda t: grid_coords(t, ulysses, ring, low)[1])
        positions = torch.cat([pieces[t] for t in members])  # the all-to-all's order: member by member

        def lse_index(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
            here = heads // ulysses
            return torch.arange(u * here, (u + 1) * here), positions

        def make_layer() -> nn.Module:
            if ulysses_only:
                return ulysses_layer(lambda: UlyssesAttention(sequence_process_group=ctx.tp_group, attn_type=kind))
            return LongContextAttention(ring_impl_type=ring_impl_type, attn_type=kind)

        cores = [name for name, m in reference.named_modules() if isinstance(m, ReferenceAttention)]
        if not cores:
            raise ValueError("the model has no attention core made by its factory's `attention()` "
                             "(ReferenceAttention): nothing for yunchang to replace")
        for name in cores:
            parent, _, attr = name.rpartition(".")
            setattr(reference.get_submodule(parent), attr,
                    YunchangCore(make_layer(), lse_index, swaps=swaps, backward_swaps=backward_swaps,
                                 record_lse=attn_type != "torch_math"))
        sync = [groups[g] for g in sync_groups if g in groups]

        def sync_grads() -> None:
            # SUM over the SP group = over the Ulysses group, then the ring
            sum_replicated_grads(reference, ctx, over=sync)

        layout = Layout(seq_dim=1, batch_dim=0, seq_order=seq_order(placement, ulysses, ring, low))
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
    import_yunchang()


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


ATTN_TYPES = (*CPU_ATTN_TYPES, *GPU_ONLY_ATTN_TYPES)
"""Every attention-type value of the releases in range (`AttnType`, `FlashAttentionImpl` before
0.6.0): 0.6.4's, and 'torch', its torch path's name before (tests/test_yunchang.py checks the
installed release's against it). A value the installed release lacks is UNSUPPORTED in the ranks
(`attn_type_of`)."""


def expect_torch_math(config: CheckConfig) -> str:
    """FAIL where more than one rank's attention is merged: yunchang's torch math path returns an
    LSE of zeros ("LSE is not available, use zeros as fallback"), so a ring merges its blocks
    with equal weights (docs/frameworks/yunchang.md, finding 3); one block per query is right."""
    return "FAIL" if (config.ring_degree or 1) > 1 else "PASS"


def _check_model_islands(cfg: CheckConfig, model: ModelFactory, islands: Mapping[str, str]) -> None:
    """A user's model under LongContextAttention at float64: every attention core must lie in a
    declared float32 island (yunchang's ring merges in float32), checked on a meta-device build."""
    with torch.device("meta"):
        built = model(cfg, ReferenceAttention)
    bare = [n for n in core_names(built) if not any(n == p or n.startswith(p + ".") for p in islands)]
    if bare:
        raise Unsupported(f"float64 with LongContextAttention: yunchang's ring merges in float32, so declare your "
                          f"attention cores float32 islands: precision_islands={{{', '.join(repr(n) for n in bare[:4])}"
                          f"{', ...' if len(bare) > 4 else ''}: 'float32'}} (usp_case's precision_islands=)")


def _common_validate(cfg: CheckConfig, name: str, placement: str, ulysses: int, attn_type: str) -> None:
    """The limits every yunchang layer shares: (B, S, heads, d) activations, yunchang's even
    splits of heads and tokens, the attention type's kernel."""
    sp = cfg.tp
    if cfg.layout not in (None, "bsh"):
        raise Unsupported(f"yunchang's layers take (batch, seq, heads, dim): layout {cfg.layout!r}")
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
    validate_attn_type(cfg, attn_type)


def _case_fields(case_fields: dict[str, Any], model: ModelFactory | None, tag: str,
                 loss: TokenLoss | None) -> dict[str, Any]:
    """The GPT case's fields (tokens and positions in, the token loss or `loss`: deepspeed_loss),
    the reference built by `model` (None: the project's GPT, each attention's core a submodule),
    `case_fields` over them."""
    case_fields.setdefault("setup", _import_yunchang)
    defaults = {**GPT_DEFAULTS, "causal": True, **case_fields.pop("defaults", {})}
    tags = ("yunchang", "framework", tag, *case_fields.pop("tags", ()))
    fields = gpt_fields(defaults, positions=True)
    if loss is not None:
        fields.update(gpt_loss_fields(loss, defaults))
    if model is None:
        fields["build_reference"] = build_reference
    else:
        fields["build_reference"] = lambda config: model(with_defaults(config, defaults), ReferenceAttention)
    return {**fields, "tags": tags, **case_fields}


def _model_name(model: ModelFactory) -> str:
    return getattr(model, "__qualname__", type(model).__name__)


def _check_choices(fn: str, name: str, attn_type: str, kernel: str) -> None:
    from sp_harness.cases.frameworks.flash_attn_standin import KERNELS

    if attn_type not in ATTN_TYPES:
        raise ValueError(f"{fn}({name!r}): attn_type {attn_type!r}: one of {ATTN_TYPES}")
    if kernel not in KERNELS:
        raise ValueError(f"{fn}({name!r}): kernel {kernel!r}: one of {KERNELS}")


def _validate_torch_flash_on_cuda(cfg: CheckConfig, kernel: str) -> None:
    if kernel == "torch-flash" and torch.cuda.is_available():
        hidden, heads = known(cfg.hidden, "hidden"), known(cfg.num_heads, "num_heads")
        if cfg.dtype not in ("bfloat16", "float16"):
            raise Unsupported(f"torch's CUDA flash-attention kernel takes float16 / bfloat16, not {cfg.dtype}")
        if hidden % heads or (hidden // heads) % 8:
            raise Unsupported(f"torch's CUDA flash-attention kernel needs a head dim divisible by 8: hidden "
                              f"({hidden}) / num_heads ({heads})")


def usp_case(name: str, *, ulysses_degree: int | None = None, ring_degree: int | None = None,
             ring_impl_type: str = "zigzag", use_ulysses_low: bool = True, extract: str | None = None,
             merge: Callable | None = None, forward_swaps: Mapping[str, Any] | None = None,
             sync_groups: Sequence[str] = SYNC_GROUPS, kernel: str = "exact", attn_type: str = "fa",
             model: ModelFactory | None = None, backward_swaps: Mapping[str, Any] | None = None,
             loss: TokenLoss | None = None, **case_fields: Any) -> Case:
    """A `Case` checking yunchang's `LongContextAttention` (USP) at `ulysses_degree` x
    `ring_degree` (None: whatever the run has; ring degree 2 where 2 divides the SP size) with
    `ring_impl_type` ('zigzag', 'basic', 'strip'), yunchang's group layout `use_ulysses_low` and
    its `attn_type` (an `AttnType` value: 'fa', the default; 'torch_math' forward only; the
    GPU-only ones UNSUPPORTED), inside `model` (`model(config, attention) -> nn.Module`, every
    attention core made by `attention()`; None: the project's GPT), against the same model with
    exact attention. `extract`, `merge`, `forward_swaps`, `backward_swaps`, `sync_groups`,
    `kernel`: as `yunchang_shard`'s. `loss`: your labels, loss mask, padding, label smoothing or
    loss function (`TokenLoss`; deepspeed_loss). `case_fields`: any other `Case` field (defaults,
    tags, examples, isolation, precision_islands for a user's model at float64, ...)."""
    if ring_impl_type not in RING_IMPLS:
        raise ValueError(f"usp_case({name!r}): ring_impl_type {ring_impl_type!r}: one of {RING_IMPLS}")
    _check_choices("usp_case", name, attn_type, kernel)
    placement = extract or ring_impl_type
    islands = case_fields.pop("precision_islands", None)
    if islands is None:
        islands = {f"blocks.{i}.attn.core": "float32" for i in range(MAX_LAYERS)} if model is None else {}

    def validate(cfg: CheckConfig) -> None:
        require(COMPAT, name)  # the installed release: in range, its APIs there
        ulysses, ring = degrees(cfg)
        sp = cfg.tp
        if sp % ring:
            raise Unsupported(f"ring_degree {ring} does not divide sp {sp} (yunchang: sp = ulysses x ring)")
        for what, want, got in (("ulysses_degree", ulysses_degree, ulysses), ("ring_degree", ring_degree, ring)):
            if want is not None and want != got:
                raise Unsupported(f"{name} is yunchang at {what} {want}; this run has {what} {got} "
                                  f"(sp {sp} = ulysses {ulysses} x ring {ring})")
        _common_validate(cfg, name, placement, ulysses, attn_type)
        seq_len = known(cfg.seq_len, "seq_len")
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
        _validate_torch_flash_on_cuda(cfg, kernel)
        if model is not None and cfg.dtype == "float64":
            _check_model_islands(cfg, model, islands)
        if loss is not None:
            loss_limits(cfg, loss)

    fields = _case_fields(case_fields, model, "usp", loss)
    fields.setdefault("expect", expect_torch_math if attn_type == "torch_math" else expect_float32_alias)
    desc = (f"yunchang {_release()} LongContextAttention (USP), ring_impl_type={ring_impl_type!r}, "
            f"{'' if kernel == 'exact' else f'kernel={kernel!r}, '}"
            f"{'' if attn_type == 'fa' else f'attn_type={attn_type!r}, '}"
            f"ulysses x ring = {ulysses_degree or 'sp/R'} x {ring_degree or 'R'}"
            f"{'' if use_ulysses_low else ', use_ulysses_low=False'}"
            f"{'' if model is None else ', model ' + _model_name(model)}")
    return YunchangCase(
        name=name, description=desc, validate=validate,
        shard=yunchang_shard(ring_impl_type=ring_impl_type, use_ulysses_low=use_ulysses_low, extract=extract,
                             merge=merge, sync_groups=sync_groups, forward_swaps=forward_swaps, kernel=kernel,
                             attn_type=attn_type, backward_swaps=backward_swaps),
        precision_islands=islands, fixed_ring_degree=ring_degree, fixed_ulysses_degree=ulysses_degree, **fields)


ULYSSES_TORCH_KERNEL = ("whatever the torch attn_type, UlyssesAttention runs it through ring_pytorch_attn_func, "
                        "whose blocks call aten's _scaled_dot_product_flash_attention (pytorch_attn_forward's default "
                        "op_type), which has no CPU kernel")
"""Why UlyssesAttention's torch attention types do not run on CPU ranks (yunchang 0.6.4)."""


def ulysses_case(name: str, *, attn_type: str = "fa", model: ModelFactory | None = None,
                 forward_swaps: Mapping[str, Any] | None = None, kernel: str = "exact", loss: TokenLoss | None = None,
                 **case_fields: Any) -> Case:
    """A `Case` checking yunchang's `UlyssesAttention` over the run's whole SP group (its
    `sequence_process_group`; no ring: ring degree 1) with `attn_type` ('fa': flash-attn's
    `flash_attn_func`, the CPU stand-in's where no GPU is visible), inside `model` (as
    `usp_case`'s; None: the project's GPT), against the same model with exact attention. The
    tokens are placed contiguously (`basic_extract_local`: the all-to-all gathers them in rank
    order). `forward_swaps`: names of `yunchang.ulysses.attn_layer` replaced during each forward
    (a mutant's). `loss`: as `usp_case`'s. `case_fields`: any other `Case` field."""
    _check_choices("ulysses_case", name, attn_type, kernel)

    def validate(cfg: CheckConfig) -> None:
        require(COMPAT, name)
        if cfg.ring_degree not in (None, 1):
            raise Unsupported(f"UlyssesAttention has no ring: ring_degree {cfg.ring_degree} asked (1, or usp_case's "
                              "LongContextAttention)")
        if attn_type.startswith("torch_") and not torch.cuda.is_available():
            raise Unsupported(f"yunchang attn_type {attn_type!r} in UlyssesAttention: {ULYSSES_TORCH_KERNEL}")
        _common_validate(cfg, name, "basic", cfg.tp, attn_type)
        _validate_torch_flash_on_cuda(cfg, kernel)
        if loss is not None:
            loss_limits(cfg, loss)

    fields = _case_fields(case_fields, model, "ulysses", loss)
    desc = (f"yunchang {_release()} UlyssesAttention over the SP group"
            f"{'' if kernel == 'exact' else f', kernel={kernel!r}'}"
            f"{'' if attn_type == 'fa' else f', attn_type={attn_type!r}'}"
            f"{'' if model is None else ', model ' + _model_name(model)}")
    return YunchangCase(
        name=name, description=desc, validate=validate,
        shard=yunchang_shard(layer="ulysses", attn_type=attn_type, forward_swaps=forward_swaps, kernel=kernel,
                             sync_groups=("ulysses",)),
        fixed_ring_degree=1, **fields)


__all__ = ["ATTN_TYPES", "CAUSAL_ONLY", "CPU_ATTN_TYPES", "GPU_ONLY_ATTN_TYPES", "LAYERS", "MAX_LAYERS",
           "NO_BACKWARD_ATTN_TYPES", "RING_IMPLS", "SYNC_GROUPS", "YUNCHANG_VERSION", "ModelFactory", "YunchangCase",
           "ULYSSES_TORCH_KERNEL", "attn_type_of", "expect_float32_alias", "expect_torch_math",
           "refuse_gloo_ring_of_one", "refuse_on_cpu_tensors", "ulysses_case", "usp_case", "validate_attn_type",
           "yunchang_shard"]
