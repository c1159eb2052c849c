"""Mutants whose numbers are right but whose memory or communication is not what SP promises.

Stage: config and step. The engine's numeric checks pass on these (the math is exact); only the
activation-memory check (`sp_harness.checks.activation_memory.activation_gate`) and the communication check
(`sp_harness.checks.activation_memory.comm_gate`) kill them.

`mutant-sp-full-sequence-norms`: every layer all-gathers its sequence shard on entry, runs the
whole layer tensor-parallel on the FULL sequence (norms, residual adds and the region where
Megatron has its dropouts see all s tokens, replicated over TP, with an all-reduce after each
row-parallel linear) and keeps only its own shard on exit. Embeddings, the final norm and the LM
head stay on the shard, so inputs, outputs and losses are those of SP. Because the layer's norms
and row-parallel biases see the full sequence their grads are complete on every rank and are not
summed over TP (only the shard-applied embeddings, final norm and LM head are): numerics pass.
Per layer it saves the TP amount of activations (norm inputs sbh, not sbh/t) and moves an
all-reduce per region plus an all-gather and split per layer instead of the reduce-scatter +
all-gather pairs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sp_harness.cases.common import as_gpt, known
from sp_harness.cases.megatron import mappings as mp
from sp_harness.cases.megatron.cases import SP
from sp_harness.cases.megatron.impl import CORRECT
from sp_harness.cases.megatron.layers import Parallel
from sp_harness.cases.megatron.model import ParallelBlock, ParallelGPT, copy_pieces, param_specs
from sp_harness.config.case import Layout, Sharded
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant
from sp_harness.config.shards import chunk_sizes

# forward: all-gather on seq; backward: keep this rank's piece (the grad is replicated over TP
# downstream, so a reduce-scatter would count it t times): Megatron's
# gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)
gather_keep_grad = mp.seq_mapping(
    "_GatherToFullSequence", mp.all_gather_seq, mp.split_seq,
    "forward: all-gather on seq; backward: split (the grad is replicated over TP)",
)


class FullSequenceBlock(ParallelBlock):
    """A TP block on the full sequence between an all-gather on entry and a split on exit."""

    def __init__(self, cfg, head_sizes, ffn_sizes, tp_parallel: Parallel, sp_parallel: Parallel):
        super().__init__(cfg, head_sizes, ffn_sizes, tp_parallel)
        self.sp = sp_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sp = self.sp
        full = gather_keep_grad(x, sp.seq_dim, sp.seq_sizes, sp.group)  # BUG: full sequence before the norms
        y = super().forward(full)
        return mp.scatter_to_sp(y, sp.seq_dim, sp.seq_sizes, sp.group)


def _shard_full_sequence(ref: nn.Module, ctx: RankContext) -> Sharded:
    cfg = as_gpt(ref).cfg
    layout = known(ctx.config.layout, "layout")
    sp = Parallel(impl=CORRECT, group=ctx.tp_group, tp=ctx.tp, tp_rank=ctx.tp_rank, seq_dim=CORRECT.seq_dim(layout),
                  sequence_parallel=True, seq_sizes=tuple(ctx.seq_shards))
    tp = dataclasses.replace(sp, sequence_parallel=False, seq_sizes=(known(ctx.config.seq_len, "seq_len"),))
    ref_dtype = next(ref.parameters()).dtype
    with torch.device(ctx.device):
        model = ParallelGPT(cfg, sp, layout)  # embeddings, final norm, LM head on the shard (marked)
        heads, ffn = chunk_sizes(cfg.num_heads, ctx.tp), chunk_sizes(cfg.ffn, ctx.tp)
        model.blocks = nn.ModuleList(FullSequenceBlock(cfg, heads, ffn, tp, sp) for _ in range(cfg.num_layers))
        model = model.to(ref_dtype)
    specs = param_specs(model)
    copy_pieces(model, ref, specs, ctx.tp_rank)
    io = Layout(seq_dim=1, batch_dim=0, seq_sharded=True)
    return Sharded(module=model, input_layout=io, output_layout=io, params=specs,
                   sync_grads=lambda: CORRECT.sync_grads(model, ctx, CORRECT, True))


FULL_SEQUENCE_NORMS = mutant(
    SP, name="mutant-sp-full-sequence-norms", tags=("memory",),
    summary="all-gathers the sequence before the norms (numerically exact)",
    bug="keeps full-sequence activations: each layer all-gathers the sequence before its norms and runs "
               "norms, residuals and dropout regions on all s tokens (replicated over TP, all-reduce after "
               "each row-parallel linear), so numerics match SP but activations per layer are TP's "
               "(norm inputs sbh instead of sbh/t) and communication differs; the SP memory saving of "
               "Korthikanti et al. 2022 (arXiv 2205.05198, section 4.2.2) is silently lost",
    source="Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2",
    shard=_shard_full_sequence,
    killed_by=("collective accounting", "comm-vs-tp"),
)
