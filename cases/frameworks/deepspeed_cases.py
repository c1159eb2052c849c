"""Stage: build reference + sharded. DeepSpeed-Ulysses' built-in cases (registered where
DeepSpeed is installed): DeepSpeed 0.19.8's `DistributedAttention` around torch's SDPA in the
reference GPT, its grads reduced by DeepSpeed's engine, and the bugs its users have shipped,
expressed through DeepSpeed's own knobs (`scatter_idx` / `gather_idx`, the `batch_dim_idx` its
forward is told, the `mpu` its engine is given) or the all-to-all's autograd edge."""

from sp_harness.cases.frameworks import installed
from sp_harness.cases.frameworks.deepspeed_ulysses import (
    detached,
    hf_ulysses_case,
    sdpa_attention,
    ulysses_case,
    ulysses_shard,
)
from sp_harness.config.case import Example, mutant, register

ISOLATION = "deepspeed"
"""DeepSpeed's comm backend, its sequence-parallel groups and its `groups.mpu` are process-wide:
its cases share processes only with each other."""

DS_ULYSSES = register(ulysses_case(
    "ds-ulysses", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="SP 2: 12 tokens 6/6, 4 heads 2/2, DeepSpeed's engine"),
              Example(fields=(("world_size", 3),),
                      note="SP 3: 4 heads 2/1/1 through DeepSpeed's uneven-heads all-to-all"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "bfloat16")),
                      note="DP 2 x SP 2 in bfloat16, the engine's sum over SP and mean over DP"),
              Example(fields=(("world_size", 2), ("layout", "sbh"), ("num_kv_heads", 2)),
                      note="DeepSpeed's seq-first layout (batch_dim_idx 1, gather_idx 0), grouped-query k/v"))))

DS_ULYSSES_F64 = register(ulysses_case(
    "ds-ulysses-f64", grad_sync="all-reduce", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="float64: DeepSpeed's all-to-alls at full precision"),)))
"""float64, which DeepSpeed's engine refuses to reduce: its grad sum written out."""

mutant(DS_ULYSSES, name="mutant-ds-ulysses-detached-a2a",
       summary="q/k/v reach the local attention detached from DeepSpeed's all-to-all",
       bug="DeepSpeed's all-to-all sends no grad back: the q/k/v projections never learn (forward exact)",
       source="deepspeedai/DeepSpeed#8491",
       shard=ulysses_shard(local_attention=detached(sdpa_attention)))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-batch-dim-idx",
       summary="[b, s, h, d] tensors handed to DistributedAttention with batch_dim_idx=1 (seq-first)",
       bug="the all-to-all told the wrong batch dim: batch taken for sequence, attention over the wrong tokens",
       source="deepspeedai/DeepSpeed#5808",
       shard=ulysses_shard(local_attention=sdpa_attention, batch_dim_idx=1))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-scatter-gather-swapped",
       summary="DistributedAttention(scatter_idx=1, gather_idx=2): the head and sequence dims swapped",
       bug="the first all-to-all scatters the sequence and gathers heads instead of the reverse",
       source="deepspeedai/DeepSpeed#4359",
       shard=ulysses_shard(local_attention=sdpa_attention, scatter_idx=1, gather_idx=2))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-engine-without-sp-group",
       summary="deepspeed.initialize without the sequence-parallel mpu",
       bug="grads averaged over every rank instead of summed over SP and averaged over DP (1/sp too small)",
       source="deepspeedai/DeepSpeed#5555",
       shard=ulysses_shard(local_attention=sdpa_attention, mpu=False))

if installed("transformers"):
    DS_ULYSSES_HF = register(hf_ulysses_case(
        "ds-ulysses-hf-llama", isolation=ISOLATION,
        examples=(Example(fields=(("world_size", 2),), note="UlyssesSPAttentionHF (sdpa) on a tiny HF Llama, SP 2"),
                  Example(fields=(("world_size", 4), ("dtype", "bfloat16")), note="SP 4: one head per rank, bfloat16"))))
    """DeepSpeed's Arctic (ALST) Ulysses for HF transformers: registered over transformers' sdpa."""
