"""Stage: config and step. yunchang's built-in cases (registered where yunchang
is installed): its LongContextAttention (USP) with the zigzag ring at the run's Ulysses x ring
degrees, its UlyssesAttention over the SP group, and the bugs their users have shipped, expressed
through yunchang's own code paths (the replacements the mutants hand to yunchang are here,
beside them)."""

from typing import Any

import torch

from sp_harness.cases.frameworks.yunchang.case import ulysses_case, usp_case, yunchang_shard
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

ISOLATION = "yunchang"
"""yunchang's PROCESS_GROUP and the CPU shim are process-wide: its cases share processes only
with each other."""

YC_USP = register(usp_case(
    "yc-usp", ring_impl_type="zigzag", isolation=ISOLATION,
    # float32 is left out: yunchang's ring backward aliases its float32 accumulator there
    # (docs/frameworks/yunchang.md, finding 1); flash-attn itself takes float16/bfloat16 only
    examples=(Example(fields=(("world_size", 4), ("dtype", "float64")),
                      note="yunchang ulysses 2 x ring 2 (zigzag), 12 tokens 3 per rank, float32 merge island"),
              Example(fields=(("world_size", 2), ("dtype", "bfloat16")), note="yunchang ring 2 (zigzag), pure ring"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "bfloat16")),
                      note="yunchang DP 2 x ring 2, grads averaged over DP"))))

YC_USP_TORCH_FLASH = register(usp_case(
    "yc-usp-torch-flash", ring_impl_type="zigzag", kernel="torch-flash", isolation=ISOLATION,
    # yunchang's ring on the kernels users train with: FlashAttention-2 where a GPU is visible,
    # aten's CPU flash kernel otherwise; both round P and dS to the run dtype, as flash-attn does
    examples=(Example(fields=(("world_size", 2), ("dtype", "bfloat16")),
                      note="yunchang ring 2 (zigzag) on torch's flash kernels"),
              Example(fields=(("world_size", 4), ("dtype", "bfloat16")),
                      note="yunchang ulysses 2 x ring 2 (zigzag) on torch's flash kernels"))))

YC_ULYSSES = register(ulysses_case(
    "yc-ulysses", isolation=ISOLATION,
    # no ring, so no float32 accumulator to alias: float32 passes too
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")), note="yunchang UlyssesAttention over 2 ranks"),
              Example(fields=(("world_size", 4), ("dtype", "bfloat16")),
                      note="yunchang UlyssesAttention over 4 ranks, one head each"))))


def overwriting_merge(out, lse, block_out, block_lse, slice_=None):
    """A ring merge that keeps the latest block and drops the running (out, lse): what yunchang's
    `ring_flash_attn_forward` does on its SPARSE_SAGE path (`out, lse = block_out, block_lse`,
    feifeibear/long-context-attention#176). Same shapes and dtypes as `update_out_and_lse`."""
    new_out = block_out.to(torch.float32)
    new_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    if out is None or slice_ is None:
        return new_out, new_lse
    out[slice_], lse[slice_] = new_out, new_lse
    return out, lse


def diagonal_mask_on_every_block(impl_type, *args, **kwargs):
    """A `select_flash_attn_impl` whose kernels apply the causal mask to every block, received
    k/v blocks included (where yunchang passes causal=False: they lie wholly before or after the
    queries): the ring-block masking error of zhuzilin/ring-flash-attention#54. Its arguments go
    to yunchang's as given (`stage`, and from 0.6.2 `attn_processor`)."""
    from yunchang.kernels import select_flash_attn_impl

    fn = select_flash_attn_impl(impl_type, *args, **kwargs)

    def masked(*args, **kwargs):
        kwargs["causal"] = True
        return fn(*args, **kwargs)

    return masked


mutant(YC_USP, name="mutant-yc-zigzag-contiguous-shards",
       summary="zigzag ring fed contiguous shards (basic_extract_local)",
       bug="the input sharded contiguously while the ring runs yunchang's zigzag schedule: the causal "
           "masks assume chunks r and 2R-1-r",
       source="feifeibear/long-context-attention#53 (hybrid zigzag test fed unreordered inputs; fixed by #74)",
       shard=yunchang_shard(ring_impl_type="zigzag", extract="basic"), killed_by=("forward", "even"))

mutant(YC_USP, name="mutant-yc-ring-merge-overwrites",
       summary="ring merge keeps the last block (out, lse = block_out, block_lse)",
       bug="the ring's per-step merge overwrites the running output and LSE instead of the LSE-weighted "
           "update_out_and_lse (yunchang's SPARSE_SAGE path)",
       source="feifeibear/long-context-attention#176",
       shard=yunchang_shard(ring_impl_type="zigzag", merge=overwriting_merge), killed_by=("forward", "even"))

mutant(YC_USP, name="mutant-yc-grad-sync-ulysses-only",
       summary="replicated grads summed over yunchang's ULYSSES_PG only",
       bug="grad all-reduce over a sub-group of SP: the ring members' contributions never summed",
       source="bug class: grad all-reduce over a sub-group of SP (arXiv:2309.14509 section 3; GPT-NeoX PR #1259)",
       shard=yunchang_shard(ring_impl_type="zigzag", sync_groups=("ulysses",)), killed_by=("grad", "even"))

mutant(YC_USP, name="mutant-yc-causal-mask-on-received-blocks",
       summary="every ring block attended with the diagonal causal mask",
       bug="received k/v blocks masked as if they were the rank's own diagonal block (causal=True on every ring "
           "step, not only where yunchang passes it)",
       source="zhuzilin/ring-flash-attention#54 (causal masking of the off-diagonal ring blocks)",
       shard=yunchang_shard(ring_impl_type="zigzag",
                            forward_swaps={"select_flash_attn_impl": diagonal_mask_on_every_block}),
       killed_by=("forward", "even"))


class AllToAllDefaultIndices:
    """yunchang's `SeqAllToAll4D` with every call's scatter / gather indices dropped, so each
    all-to-all runs with `all_to_all_4D`'s defaults (scatter 2, gather 1), the output's too:
    `_SeqAllToAll4D.forward` called `all_to_all_4D(input, group=group)` before
    feifeibear/long-context-attention#4. The output then has the right number of elements and
    the wrong layout: (B, S x P, heads / P^2, d) read back as (B, S / P, heads, d)."""

    @staticmethod
    def apply(group, tensor, scatter_idx, gather_idx, use_sync=False):
        from yunchang.comm.all_to_all import SeqAllToAll4D

        return SeqAllToAll4D.apply(group, tensor, 2, 1, use_sync)


class StaleKVBackward:
    """A `select_flash_attn_impl` for the ring's backward whose block backward always gets this
    rank's own k/v (the step-0 ones, kept from the causal diagonal call), never the k/v received
    around the ring: huggingface/diffusers#14265 (a ring backward whose every hop recomputed
    against the K/V saved at iteration 0). The forward is untouched; dq, dk, dv are wrong."""

    def __init__(self):
        self.local: tuple | None = None

    def __call__(self, impl_type, stage: str = "fwd-bwd", *args, **kwargs):
        from yunchang.kernels import select_flash_attn_impl

        fn = select_flash_attn_impl(impl_type, stage, *args, **kwargs)  # `attn_processor` from 0.6.2
        if stage != "bwd-only":
            return fn

        def backward(dout, q, k, v, *rest, **kwargs):
            if rest[7]:  # causal: the diagonal block, step 0 of the ring
                self.local = (k, v)
            elif self.local is not None:
                k, v = self.local[0][:, :k.shape[1]], self.local[1][:, :v.shape[1]]
            return fn(dout, q, k, v, *rest, **kwargs)

        return backward


mutant(YC_ULYSSES, name="mutant-yc-ulysses-a2a-default-indices",
       summary="UlyssesAttention's all-to-alls all run with the default scatter 2 / gather 1",
       bug="SeqAllToAll4D drops its scatter/gather indices, so the output all-to-all scatters heads again "
           "instead of gathering them: same element count, scrambled (seq, head) layout",
       source="feifeibear/long-context-attention#4 (fix a bug in all-to-all args)",
       shard=yunchang_shard(layer="ulysses", sync_groups=("ulysses",),
                            forward_swaps={"SeqAllToAll4D": AllToAllDefaultIndices}),
       killed_by=("forward", "even"))

mutant(YC_USP, name="mutant-yc-ring-backward-stale-kv",
       summary="the ring backward recomputes every hop against this rank's own k/v",
       bug="the zigzag ring's backward block kernels get the step-0 (local) k/v on every ring step instead of "
           "the k/v received from the previous rank: forward and LSE right, dq/dk/dv wrong",
       source="huggingface/diffusers#14265 (ring attention backward uses stale iteration-0 KV)",
       shard=yunchang_shard(ring_impl_type="zigzag", backward_swaps={"select_flash_attn_impl": StaleKVBackward()}),
       killed_by=("grad", "even"))


def set_seq_parallel_pg_before_dp(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True):
    """yunchang's `set_seq_parallel_pg` before feifeibear/long-context-attention#50: the same
    groups made in the same order (rewritten compactly): they tile the whole world, not each DP
    replica's SP ranks, so with DP > 1 a ring strides across replicas (world 4, DP 2 x ring 2:
    rings {0, 2} and {1, 3})."""
    from yunchang.globals import PROCESS_GROUP

    num_ulysses_pgs, num_ring_pgs = world_size // sp_ulysses_degree, world_size // sp_ring_degree
    if use_ulysses_low:
        ulysses_sets = [list(range(i * sp_ulysses_degree, (i + 1) * sp_ulysses_degree)) for i in range(num_ulysses_pgs)]
        ring_sets = [list(range(i, world_size, num_ring_pgs)) for i in range(num_ring_pgs)]
        order = (("ulysses", ulysses_sets), ("ring", ring_sets))
    else:
        ring_sets = [list(range(i * sp_ring_degree, (i + 1) * sp_ring_degree)) for i in range(num_ring_pgs)]
        ulysses_sets = [list(range(i, world_size, num_ulysses_pgs)) for i in range(num_ulysses_pgs)]
        order = (("ring", ring_sets), ("ulysses", ulysses_sets))
    mine = {}
    for kind, sets in order:  # every rank makes every group, in yunchang's order
        for ranks in sets:
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = mine["ulysses"], mine["ring"]


mutant(YC_USP, name="mutant-yc-groups-across-dp-replicas",
       summary="yunchang's process groups made as before its DP support: rings stride across DP replicas",
       bug="set_seq_parallel_pg tiles the world instead of each replica's SP ranks, so at DP 2 x ring 2 ranks 0 and "
           "2 form a ring: each rank's attention runs over another replica's sequence (inputs placed by SP rank, as "
           "the DP-aware extract does)",
       source="feifeibear/long-context-attention#50 (set_seq_parallel_pg compatible with DP process group)",
       shard=yunchang_shard(ring_impl_type="zigzag", set_pg=set_seq_parallel_pg_before_dp),
       killed_by=("forward", "dp2xtp2"))


class RingGradsOneShort:
    """yunchang's `ZigZagRingFlashAttnFunc` whose backward returns one grad fewer than its forward
    takes inputs: the shape of feifeibear/long-context-attention#156 (an argument added to
    `RingFlashAttnFunc.forward` in 9613d6f without a None for it in `backward`). Built on first
    use: registering imports no yunchang code."""

    function: Any = None

    @classmethod
    def apply(cls, *args):
        if cls.function is None:
            # yunchang's own class: its module's name is this one while the swap is in place
            ring = next(c for c in torch.autograd.Function.__subclasses__()
                        if c.__module__ == "yunchang.ring.zigzag_ring_flash_attn"
                        and c.__name__ == "ZigZagRingFlashAttnFunc")

            class OneShort(ring):
                @staticmethod
                def backward(ctx, *grads):
                    return ring.backward(ctx, *grads)[:-1]

            cls.function = OneShort
        return cls.function.apply(*args)


mutant(YC_USP, name="mutant-yc-ring-backward-grad-count",
       summary="the zigzag ring's autograd function returns one grad fewer than its inputs",
       bug="autograd refuses the ring's backward ('returned an incorrect number of gradients'): any training step "
           "with the ring raises in backward, the forward is right",
       source="feifeibear/long-context-attention#156 (Fix backward gradient count mismatch, RingFlashAttnFunc)",
       shard=yunchang_shard(ring_impl_type="zigzag", forward_swaps={"ZigZagRingFlashAttnFunc": RingGradsOneShort}),
       killed_by=("crash", "even"))
