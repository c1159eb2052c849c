"""Stage: config and step. yunchang's built-in cases (registered where yunchang
is installed): its LongContextAttention (USP) with the zigzag ring at the run's Ulysses x ring
degrees, and the bugs USP users have shipped, expressed through yunchang's own code paths (the
two replacement functions the mutants hand to yunchang are here, beside them)."""

import torch

from sp_harness.cases.frameworks.yunchang import usp_case, yunchang_shard
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


def diagonal_mask_on_every_block(impl_type, stage: str = "fwd-bwd", attn_processor=None):
    """A `select_flash_attn_impl` whose kernels apply the causal mask to every block, received
    k/v blocks included (where yunchang passes causal=False: they lie wholly before or after the
    queries): the ring-block masking error of zhuzilin/ring-flash-attention#54."""
    from yunchang.kernels import select_flash_attn_impl

    fn = select_flash_attn_impl(impl_type, stage, attn_processor)

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
