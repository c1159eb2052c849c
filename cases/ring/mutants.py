"""Broken variants of ring-gpt: each is the correct `Impl` (or loss) with one piece swapped.

Stage: config and step. Which configs expose each one is in the comment next to it. The battery
runs ring-gpt at its defaults (zigzag, causal), non-causal in its 'noncausal' entry, and the
load-balance check in its 'balance' entry.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from sp_harness.cases.ring.attention import CORRECT, Partial
from sp_harness.cases.ring.cases import RING, ring_shard
from sp_harness.cases.ring.mappings import Ring, exchange
from sp_harness.cases.ring.placement import block_mask, contiguous_order
from sp_harness.config.registry import mutant

TAGS = ("ring",)


def ring_mutant(name: str, summary: str, bug: str, *, source: str, local_loss=None, killed_by: tuple[str, ...] = (),
                **swap):
    """`CORRECT` with the `Impl` fields in `swap` replaced, registered as a mutant of ring-gpt."""
    return mutant(RING, name=name, summary=summary, bug=bug, source=source, killed_by=killed_by, tags=TAGS,
                  shard=ring_shard(dataclasses.replace(CORRECT, **swap), local_loss=local_loss))


# (a) any config with cp > 1: k_proj / v_proj grads miss every other rank's queries' share.
class _ShiftNoGradBack(torch.autograd.Function):
    """forward: send the k/v block to the next rank, return the previous rank's; backward: the
    grad of the received copy is dropped (zeros), never sent back to the rank that owns it."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, ring: Ring, recv_len: int) -> torch.Tensor:
        shape = kv.shape[:-2] + (recv_len, kv.shape[-1])
        return exchange(kv, ring.next, kv.new_empty(shape), ring.prev, ring.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, None


DKV_NOT_SENT_BACK = ring_mutant(
    "mutant-ring-dkv-not-sent-back",
    "k/v grads of received blocks not sent back around the ring",
    "context-parallel backward with wrong dK/dV: the grads of the k/v blocks a rank received are "
    "never returned to the rank that projected them, so each rank's k/v projections learn only "
    "from its own queries (wrong dK/dV under CP: NVIDIA/Megatron-LM#1465; TransformerEngine#1557)",
    source="NVIDIA/Megatron-LM#1465; NVIDIA/TransformerEngine#1557",
    shift=lambda kv, ring, recv_len: _ShiftNoGradBack.apply(kv, ring, recv_len),
    killed_by=("grad", "even"),
)

# (b') zigzag and causal (the battery's every entry): the mask is built in the original order.
MASK_IGNORES_BALANCER = ring_mutant(
    "mutant-ring-mask-ignores-zigzag",
    "causal mask built from contiguous positions while the tokens are zigzag-placed",
    "causal mask of load-balanced context parallelism built in the original sequence order instead "
    "of the load balancer's reordered one: each rank masks as if it held a contiguous shard, so "
    "queries see future keys and miss past ones (the fix for pytorch/pytorch#147793, PR #177583, "
    "had to reconstruct CP's load-balanced order and build the causal mask in that reordered space)",
    source="pytorch/pytorch#147793; pytorch/pytorch PR #177583",
    mask_placement=lambda balancer: contiguous_order,
    killed_by=("forward", "even"),
)


# (c) zigzag with seq_len % 2W != 0 (the battery's uneven entry: 10 tokens over 3 ranks).
def _tail_dropped(k_pos: torch.Tensor, seq_len: int, world: int, balancer: str) -> torch.Tensor:
    """Keys past the last whole 2W-chunk: what seq_len // (2W)-sized zigzag chunks never cover."""
    if balancer != "zigzag":
        return torch.zeros_like(k_pos, dtype=torch.bool)
    return k_pos >= (seq_len // (2 * world)) * 2 * world


TAIL_DROPPED = ring_mutant(
    "mutant-ring-zigzag-drops-tail",
    "zigzag chunks of seq_len // 2W tokens: the tail never enters the ring",
    "zigzag split computing chunk = seq_len // (2 * cp) and slicing whole chunks: when seq_len % (2 * cp) "
    "!= 0 the tail tokens are silently dropped (NVIDIA-BioNeMo/bionemo-recipes PR #1480 review: "
    "'If seq_len % (2 * cp_world_size) != 0, the current logic drops tail tokens'); here their "
    "keys/values never reach any query",
    source="NVIDIA-BioNeMo/bionemo-recipes PR #1480",
    keys_dropped=_tail_dropped,
    killed_by=("forward", "uneven"),
)


# (d) any config: the running normaliser is the larger block's lse, not their log-sum-exp.
def _max_merge(acc: Partial, part: Partial) -> Partial:
    (out, lse), (out_b, lse_b) = acc, part
    new = torch.maximum(lse, lse_b)  # wrong: the merged normaliser is logaddexp, not max
    return out * (lse - new).exp() + out_b * (lse_b - new).exp(), new


MAX_MERGE = ring_mutant(
    "mutant-ring-merge-by-max",
    "partial outputs merged by the max of their lse, not their log-sum-exp",
    "online-softmax merge of ring-attention partials rescaled by the running max only (the flash "
    "attention statistics m and l conflated): partial outputs are weighted exp(lse_i - max) and "
    "never renormalised, so rows whose keys span several blocks are off (the merge every ring "
    "attention implements: Liu et al. 2023 'Ring Attention with Blockwise Transformers', "
    "zhuzilin/ring-flash-attention update_out_and_lse; Dao 2023 FlashAttention-2 eq. for m, l)",
    source="arXiv:2310.01889; github.com/zhuzilin/ring-flash-attention utils.py update_out_and_lse",
    merge=_max_merge,
    killed_by=("forward", "even"),
)


# (e) uneven shards (the battery's uneven entry: 4/4/2).
def _per_rank_mean_loss(out: torch.Tensor, target: torch.Tensor, ctx) -> torch.Tensor:
    """Each CP rank's mean over its own tokens, then the ranks' mean: every rank weighs the same
    whatever its token count, and a rank without tokens adds nothing but still counts."""
    local = out.new_zeros(()) if target.numel() == 0 else RING.loss_sum(out, target) / target.numel()
    return local / ctx.tp


PER_RANK_LOSS_NORM = ring_mutant(
    "mutant-ring-loss-per-rank-norm",
    "loss normalised by each CP rank's own token count",
    "per-token loss normalised by each context-parallel rank's local token count and then averaged "
    "over CP ranks: ranks with fewer (or no) targets get the wrong weight, a rank with none drops "
    "out (NVIDIA/Megatron-LM PR #7498 'a rank with no original LM targets ... discard[s] its gradient "
    "... even an all-ones mask gives different weights after CP partitioning'; PR #7513)",
    source="NVIDIA/Megatron-LM PR #7498; NVIDIA/Megatron-LM PR #7513",
    local_loss=_per_rank_mean_loss,
    killed_by=("forward (loss)", "uneven"),
)


# (g) only causal=False with load_balancer='zigzag': the mask assumes causal attention whenever
# the load balancer is on. The battery's 'noncausal' entry sees it.
CAUSAL_UNDER_BALANCER = ring_mutant(
    "mutant-ring-balancer-assumes-causal",
    "causal mask applied under the zigzag balancer even for causal=False",
    "load-balanced (zigzag) ring attention written for causal attention only: with is_causal=False "
    "the balanced path still masks as if causal (pytorch/pytorch#141429 'non-causal ring attention "
    "broken' with enable_load_balance; the fix asserted the combination unsupported, PR #141622)",
    source="pytorch/pytorch#141429; pytorch/pytorch#141622",
    mask=lambda q_pos, k_pos, causal, balancer: block_mask(q_pos, k_pos, causal or balancer == "zigzag"),
    killed_by=("forward", "noncausal"),
)

# (h) numerically correct: plain contiguous placement while load_balancer says zigzag. Only the
# battery's 'balance' entry (the load-balance check) sees it, no tensor check can.
UNBALANCED = ring_mutant(
    "mutant-ring-zigzag-unbalanced",
    "contiguous causal shards claimed as zigzag (correct numbers, rank W-1 does ~2W-1x rank 0's work)",
    "load balancer whose rearrangement does not survive the contiguous cut, here in its simplest "
    "form (the identity): with causal attention the last rank scores ~2W-1 times the first rank's "
    "pairs. Outputs stay exactly right, so no tensor check can see it (pytorch/pytorch PR #189902: "
    "the per-document head-tail balancer laid its indices out document-major, CP cut them "
    "contiguously, and some ranks inherited a document's whole causal tail; 'the existing "
    "correctness tests never caught it')",
    source="pytorch/pytorch PR #189902",
    placement=lambda balancer: contiguous_order,
    killed_by=("load balance", "balance"),
)


# (i) any config: the ring's output is right, the log-sum-exp it returns is in base 2.
LSE_BASE2 = ring_mutant(
    "mutant-ring-lse-base2",
    "log-sum-exp returned in base 2 (the output is right)",
    "an attention kernel that runs its softmax through exp2 (the fast path) and returns its LSE "
    "unconverted: base-2 units, 1/ln 2 times the natural-log logsumexp that a ring or hybrid "
    "merge of partial attentions consumes. The output is right, so only a consumer of the LSE "
    "sees it (pytorch/pytorch#181645 'flex_attention(BACKEND=FLASH) return_lse=True returns lse "
    "off by factor ln(2)', labelled correctness (silent); lightseekorg/tokenspeed PR #571)",
    source="pytorch/pytorch#181645; lightseekorg/tokenspeed PR #571",
    exposed_lse=lambda lse: lse / math.log(2),
    killed_by=("attention lse", "even"),
)
