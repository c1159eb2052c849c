"""Stage: step. Rank side: where each local parameter lives in the reference, and whether the
parameters that must stay replicated did.

Every plain (non-DTensor) parameter is mapped by its `ParamSpec` or declared replicated in
`Sharded.replicated`; the engine never guesses a mapping, so a renamed or forgotten parameter is
an error naming it, not a silently skipped check.

A declared mapping whose piece does not have the local param's shape (a param the framework's
metadata calls replicated that holds a TP chunk: megatron's unflagged attention sinks) is not a
guess the engine may skip either: where the shapes say it unambiguously (one dim differs, local x
TP = the reference's) the param is mapped by its shape and the contradiction reported as the
spec's `finding`; where they do not, a `ParamMappingError` names it before anything is judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.distributed as dist
from torch import nn

from sp_harness.config import shards as sh
from sp_harness.config.case import ParamMappingError, ParamSpec, Sharded, by_shape
from sp_harness.config.rank_context import RankContext
from sp_harness.step.context import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def param_piece(ref: torch.Tensor, spec: ParamSpec, ctx: RankContext,
                shape: torch.Size | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's piece of a reference tensor under `spec`, and the piece's offset. `shape`: the
    local param's; an index view of another shape (a strided split's blocks) is reshaped to it,
    element order kept (a copy where the view's strides do not merge: pieces are read, not written)."""
    if spec.index is not None:
        piece = spec.index(ref)
        return (piece if shape is None or piece.shape == shape else piece.reshape(shape)), ()
    if spec.dim is None:
        return ref, ()
    sizes = spec.sizes or sh.chunk_sizes(ref.shape[spec.dim], ctx.tp)
    offset = [0] * ref.dim()
    offset[spec.dim] = sh.offsets(sizes)[ctx.tp_rank]
    return sh.shard(ref, spec.dim, sizes, ctx.tp_rank), tuple(offset)


class LocalParam:
    """One local parameter and where it lives in the reference."""

    def __init__(self, local_name: str, param: nn.Parameter, spec: ParamSpec):
        self.local_name = local_name
        self.param = param
        self.dtensor = is_dtensor(param)
        self.spec = spec
        self.shape = None if is_dtensor(param) else param.shape
        """The local shape every piece of a reference tensor is judged in (None for DTensors)."""
        self.sharded_dp = False
        """A DTensor param sharded over a non-TP mesh dim (FSDP's Shard on "dp"): its local pieces
        are not replicas across DP."""
        if self.dtensor:
            from torch.distributed.tensor import Replicate

            dparam = cast("DTensor", param)
            names = dparam.device_mesh.mesh_dim_names
            if names is not None and "tp" in names and len(names) > 1:
                tp_dim = names.index("tp")
                self.replicated_tp = isinstance(dparam.placements[tp_dim], Replicate)
                self.sharded_dp = any(not isinstance(p, Replicate) for i, p in enumerate(dparam.placements)
                                      if i != tp_dim)
            elif names is not None and len(names) == 1 and names[0] != "tp":
                # one axis over more than the TP group (torchtitan's "fsdp": dp x cp flattened):
                # sharded there, it is sharded over DP too (one copy, no replicas to compare)
                self.replicated_tp = isinstance(dparam.placements[0], Replicate)
                self.sharded_dp = not self.replicated_tp
            else:
                self.replicated_tp = all(isinstance(p, Replicate) for p in dparam.placements)
        else:
            self.replicated_tp = spec.replicated_tp

    @overload
    def local(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def local(self, t: None) -> None: ...
    def local(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return cast("DTensor", t).to_local() if is_dtensor(t) else t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor for a DTensor param, this rank's piece otherwise."""
        return cast("DTensor", t).full_tensor() if self.dtensor else t

    def gathered(self, t: torch.Tensor | None, *, via: torch.dtype | None = None) -> torch.Tensor | None:
        """`full(t)`, None kept, where a DTensor's gather (a collective) runs on every rank whether
        or not this rank holds `t`: on zeros where it does not, so that a grad or buffer one rank's
        step left None cannot desync the engine's judging. Exchanged in `via` (default the param's
        dtype, a grad's own; a buffer whose dtype may differ passes float64: every rank's gather
        must match byte for byte), handed back in `t`'s own dtype (exact both ways)."""
        if not self.dtensor:
            return t
        dtype = via or self.param.dtype
        src = torch.zeros_like(self.param.detach(), dtype=dtype) if t is None else t.detach().to(dtype)
        whole = cast("DTensor", src).full_tensor()
        return None if t is None else whole.to(t.dtype)

    @overload
    def piece_of(self, ref: torch.Tensor, ctx: RankContext) -> torch.Tensor: ...
    @overload
    def piece_of(self, ref: None, ctx: RankContext) -> None: ...
    def piece_of(self, ref: torch.Tensor | None, ctx: RankContext) -> torch.Tensor | None:
        """This rank's piece of a reference tensor (the whole tensor for DTensor params)."""
        if ref is None or self.dtensor:
            return ref
        return param_piece(ref, self.spec, ctx, self.shape)[0]

    def offset(self, ref: torch.Tensor, ctx: RankContext) -> tuple[int, ...]:
        # the offset alone: no reshape of an index view into the local shape
        return () if self.dtensor else param_piece(ref, self.spec, ctx)[1]

    def full_or_piece(self, t: torch.Tensor | None, ref64: torch.Tensor, ref_lp: torch.Tensor, ctx: RankContext):
        """(value to judge, matching ref64 piece, ref_lp piece, offset)."""
        if self.dtensor:
            return self.gathered(t), ref64, ref_lp, ()
        piece64, offset = param_piece(ref64, self.spec, ctx, self.shape)
        piece_lp, _ = param_piece(ref_lp, self.spec, ctx, self.shape)
        return t, piece64, piece_lp, offset


def map_params(sharded: Sharded, ref_shapes: Mapping[str, torch.Size], case_name: str,
               ctx: RankContext | None = None) -> list[LocalParam]:
    """Every local parameter with its spec; an unmapped, unknown or uncovered name is an error.
    `ref_shapes`: the reference's param shapes by name; `ctx`: this rank's (its TP degree and
    rank), where a declared piece is checked against the local shape (`checked_spec`)."""
    specs = dict(sharded.params)
    everything = "*" in sharded.replicated
    found, undeclared = [], []
    for name, p in sharded.module.named_parameters():
        spec = specs.get(name)
        if spec is None and (is_dtensor(p) or everything or name in sharded.replicated):
            spec = ParamSpec(ref_name=name)
        if spec is None:
            undeclared.append(name)
            continue
        found.append((name, p, spec))
    if undeclared:
        raise RuntimeError(f"case {case_name}: plain params with no ParamSpec and not in Sharded.replicated: "
                           f"{sorted(undeclared)}")
    unknown = sorted({spec.ref_name for _, _, spec in found} - set(ref_shapes))
    if unknown:
        raise RuntimeError(f"case {case_name} maps local params to names the reference lacks: {unknown}")
    missing = sorted(set(ref_shapes) - {spec.ref_name for _, _, spec in found})
    if missing:
        raise RuntimeError(f"case {case_name}: reference params with no sharded counterpart: {missing}")
    if ctx is not None:
        found = [(name, p, spec if is_dtensor(p) else checked_spec(spec, p.shape, ref_shapes[spec.ref_name], ctx))
                 for name, p, spec in found]
    return [LocalParam(name, p, spec) for name, p, spec in found]


def checked_spec(spec: ParamSpec, local: torch.Size, whole: torch.Size, ctx: RankContext,
                 declared: str = "") -> ParamSpec:
    """`spec` where its piece of the reference has the local param's shape (an index view: its
    element count); else the spec the shape says, carrying the contradiction as its finding
    (`by_shape`), or `ParamMappingError` where the shape does not say it. An index that selects
    another count of elements has no shape-only reading: always the error. `declared`: what the
    metadata behind `spec` says, in the framework's words (default: the spec's own)."""
    meta = torch.empty(whole, device="meta")
    if spec.index is not None:
        piece = spec.index(meta)
        if piece.numel() == local.numel():
            return spec
        raise ParamMappingError(f"param {spec.ref_name}: local {tuple(local)} ({local.numel()} elements) of the "
                                f"reference's {tuple(whole)}, but {declared or 'its ParamSpec.index'} selects "
                                f"{tuple(piece.shape)} ({piece.numel()} elements)")
    piece_shape = param_piece(meta, spec, ctx)[0].shape
    if piece_shape == local:
        return spec
    said = declared or ("declared replicated" if spec.dim is None
                        else f"declared split on dim {spec.dim} (a piece {tuple(piece_shape)})")
    return by_shape(spec.ref_name, tuple(local), tuple(whole), ctx.tp, said)


def declared_grad(param: torch.Tensor, attr: str) -> torch.Tensor | None:
    """The grad an implementation left in `param.<attr>` (`Sharded.grad_attr`)."""
    return getattr(param, attr, None)


def load_declared_grads(params: list[LocalParam], attr: str) -> None:
    """Before the engine's optimizer step: the declared grads become `.grad`, in the param's dtype
    (a float32 main_grad steps a bfloat16 param as megatron's optimizer would, after its cast)."""
    if attr == "grad":
        return
    for p in params:
        g = declared_grad(p.param, attr)
        p.param.grad = None if g is None else g.detach().to(p.param.dtype).clone()


def zero_declared_grads(params: list[LocalParam], attr: str) -> None:
    """After the step: the declared grads are zeroed in place (buffers the implementation's hooks
    accumulate into, as megatron's zero_grad_buffer leaves them)."""
    if attr == "grad":
        return
    for p in params:
        g = declared_grad(p.param, attr)
        if isinstance(g, torch.Tensor):
            g.detach().zero_()


@dataclass(kw_only=True)
class Drift:
    step: int
    name: str
    """Reference name of the parameter that should be replicated."""
    group: str
    """'tp' or 'dp': across which ranks it differs."""
    max_abs: float
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return (f"step {self.step} replica drift of {self.name} across {self.group} ranks "
                f"{list(self.ranks)}: max |diff| {self.max_abs:.3g} (must be 0, bit-identical)")


def replica_drift(step: int, params: list[LocalParam], ctx: RankContext, hint: set[str]) -> list[Drift]:
    """Bit-for-bit comparison of replicated params across TP ranks, and of all params across DP
    (but those sharded over DP, FSDP's: one copy, nothing to drift)."""
    drifts = []
    checks = []
    if ctx.tp > 1:
        checks.append(("tp", ctx.tp_group, ctx.tp_ranks, [p for p in params if p.replicated_tp or p.spec.ref_name in hint]))
    if ctx.dp > 1:
        checks.append(("dp", ctx.dp_group, ctx.dp_ranks, [p for p in params if not p.sharded_dp]))
    for label, group, ranks, plist in checks:
        if not plist:
            continue
        # one flat buffer, one collective: bookkeeping cost independent of the parameter count
        flat = torch.cat([p.local(p.param.detach()).reshape(-1).to(torch.float64) for p in plist])
        gathered = [torch.empty_like(flat) for _ in ranks]
        dist.all_gather(gathered, flat, group=group)
        diffs = torch.stack([(g - flat).abs() for g in gathered]).amax(0)
        at = 0
        for p in plist:
            n = p.local(p.param).numel()
            d = float(diffs[at:at + n].max()) if n else 0.0
            at += n
            if d > 0 or not torch.isfinite(torch.tensor(d)):
                drifts.append(Drift(step=step, name=p.spec.ref_name, group=label, max_abs=d, ranks=ranks))
    return drifts


def wrapper_prefix(params: list[LocalParam]) -> str:
    """What a wrapper adds before every reference name ("module." under DDP, megatron's
    Float16Module or DeepSpeed's engine), read from the declared mapping: the one prefix every
    plain param's local name has before its reference name, or "" where there is none or they
    disagree."""
    prefixes = {p.local_name[:-len(p.spec.ref_name)] for p in params
                if not p.dtensor and p.local_name.endswith(p.spec.ref_name)}
    if len(prefixes) != 1:
        return ""
    prefix = prefixes.pop()
    return prefix if prefix.endswith(".") and all(not p.dtensor and p.local_name.startswith(prefix) for p in params) else ""

