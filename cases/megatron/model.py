"""The Megatron-style TP (+ SP) twin of reference.gpt.GPT, and how it is cut from the reference.

Stage: step. Parameter names are the reference's, so `Sharded.params` maps each local
parameter to the same name with its split.

What is split and what is replicated over the TP group:
  * token embedding, position embedding, final norm and LM head: REPLICATED (not vocab-parallel).
    Under SP each rank embeds only its own tokens (the engine hands it its token slice) with the
    shard's GLOBAL position ids, and the final norm and LM head run on the local shard, so the
    logits stay sequence-sharded. TP only: tokens and logits are replicated.
  * block norms: replicated; they run on sequence shards (SP) or on the full sequence (TP).
  * attention: heads split over TP (q/k/v column-parallel, out_proj row-parallel).
  * MLP: ffn split over TP (fc1 column-parallel, fc2 row-parallel).
  * row-parallel biases: replicated, added once after the reduction.
Under SP the grads of every replicated parameter applied on shards are partial sums over TP
and are all-reduced in `sync_grads` (they carry `sequence_parallel = True`).

Activation layouts: "bsh" keeps [b, s, h] (GPT-NeoX, seq dim 1); "sbh" transposes to [s, b, h]
after the embedding (Megatron, seq dim 0) and back before returning [b, s, V] logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from sp_harness.cases.common import as_gpt, known
from sp_harness.cases.megatron.impl import Impl
from sp_harness.cases.megatron.layers import Parallel, ParallelAttention, ParallelMLP, make_norm
from sp_harness.config.case import Layout, ParamSpec, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.shards import chunk_sizes, shard


class ParallelBlock(nn.Module):
    def __init__(self, cfg, head_sizes, ffn_sizes, parallel: Parallel):
        super().__init__()
        self.norm1 = make_norm(cfg.norm, cfg.hidden, cfg.eps, parallel)
        self.attn = ParallelAttention(cfg.hidden, cfg.hidden // cfg.num_heads, head_sizes, parallel)
        self.norm2 = make_norm(cfg.norm, cfg.hidden, cfg.eps, parallel)
        self.mlp = ParallelMLP(cfg.hidden, ffn_sizes, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ParallelGPT(nn.Module):
    """tokens [b, s_local] (SP) or [b, s] (TP) -> logits [b, s_local, V] or [b, s, V]."""

    def __init__(self, cfg, parallel: Parallel, layout: str):
        super().__init__()
        self.parallel = parallel
        self.layout = layout
        tp = parallel.tp
        head_sizes = chunk_sizes(cfg.num_heads, tp)
        ffn_sizes = chunk_sizes(cfg.ffn, tp)
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        parallel.mark(self.tok_emb.weight, "embedding")
        parallel.mark(self.pos_emb.weight, "embedding")
        self.blocks = nn.ModuleList(
            ParallelBlock(cfg, head_sizes, ffn_sizes, parallel) for _ in range(cfg.num_layers)
        )
        self.norm_f = make_norm(cfg.norm, cfg.hidden, cfg.eps, parallel)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        parallel.mark(self.lm_head.weight, "lm_head")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        n_local = tokens.shape[1]
        index = p.tp_rank if p.sequence_parallel else 0
        pos = p.impl.positions(n_local, p.seq_sizes, index, tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)  # (B, S_r, H)
        if self.layout == "sbh":
            x = x.transpose(0, 1).contiguous()  # (S_r, B, H)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm_f(x))
        if self.layout == "sbh":
            logits = logits.transpose(0, 1).contiguous()  # (B, S_r, V)
        return logits


def param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """Local name -> ParamSpec: the splits the layers declare, everything else replicated."""
    specs: dict[str, ParamSpec] = {}
    for mod_name, module in model.named_modules():
        for p_name, (dim, sizes) in getattr(module, "split", {}).items():
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            specs[name] = ParamSpec(ref_name=name, dim=dim, sizes=tuple(sizes))
    for name, _ in model.named_parameters():
        specs.setdefault(name, ParamSpec(ref_name=name))
    return specs


def copy_pieces(model: nn.Module, ref: nn.Module, specs: Mapping[str, ParamSpec], tp_rank: int) -> None:
    """Load every param of this rank's `model` with its piece of the reference param `specs` names."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = specs[name]
            full = ref_params[spec.ref_name]
            if spec.dim is not None and spec.sizes is None:
                raise ValueError(f"{name}: its ParamSpec splits dim {spec.dim} without sizes")
            piece = full if spec.dim is None or spec.sizes is None else shard(full, spec.dim, spec.sizes, tp_rank)
            if piece.shape != p.shape:
                raise RuntimeError(f"{name}: local shape {tuple(p.shape)} vs piece {tuple(piece.shape)}")
            p.copy_(piece)


def build_sharded(ref: nn.Module, ctx: RankContext, impl: Impl, sequence_parallel: bool) -> Sharded:
    """Cut this rank's Megatron twin out of its copy of the reference (already in run dtype)."""
    cfg = as_gpt(ref).cfg
    layout = known(ctx.config.layout, "layout")
    parallel = Parallel(
        impl=impl,
        group=ctx.tp_group,
        tp=ctx.tp,
        tp_rank=ctx.tp_rank,
        sequence_parallel=sequence_parallel,
        seq_dim=impl.seq_dim(layout),
        seq_sizes=tuple(ctx.seq_shards) if sequence_parallel else (known(ctx.config.seq_len, "seq_len"),),
    )
    ref_dtype = next(ref.parameters()).dtype
    with torch.device(ctx.device):
        model = ParallelGPT(cfg, parallel, layout).to(ref_dtype)
    specs = param_specs(model)
    copy_pieces(model, ref, specs, ctx.tp_rank)
    io = Layout(seq_dim=1, batch_dim=0, seq_sharded=sequence_parallel)
    return Sharded(
        module=model,
        input_layout=io,
        output_layout=io,
        params=specs,
        sync_grads=lambda: impl.sync_grads(model, ctx, impl, sequence_parallel),
        local_loss=impl.local_loss,
    )
