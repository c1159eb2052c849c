"""Stage: build reference + sharded. megatron-core's built-in cases (registered where
megatron-core is installed): its GPTModel with sequence parallelism at the run's TP, and the
bugs SP users have shipped, expressed through megatron's own knobs."""

from sp_harness.cases.frameworks.megatron_core import drop_sequence_parallel_flag, megatron_case, megatron_shard
from sp_harness.config.case import Example, mutant, register

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, sequence_parallel=True)
ISOLATION = "megatron-core"
"""megatron's parallel_state and CPU shims are process-wide: its cases share processes only
with each other."""

MCORE_GPT_TP = register(megatron_case(
    "mcore-gpt-tp", {**CONFIG, "sequence_parallel": False}, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")), note="megatron-core TP 2, no SP"),)))

MCORE_GPT_SP = register(megatron_case(
    "mcore-gpt-sp", CONFIG, isolation=ISOLATION, twin=MCORE_GPT_TP.name, baseline=MCORE_GPT_TP.name,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")), note="megatron-core TP 2 + SP"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="megatron-core DP 2 x TP 2 + SP, its DDP and finalize_model_grads"))))

mutant(MCORE_GPT_SP, name="mutant-mcore-norm-flag-dropped",
       summary="input_layernorm.weight lost its sequence_parallel flag",
       bug="a LayerNorm param's grad not all-reduced over TP under sequence parallelism (through megatron's own flag)",
       source="EleutherAI/gpt-neox#1257",
       shard=megatron_shard(CONFIG, edit_model=drop_sequence_parallel_flag("decoder.layers.0.input_layernorm.weight")))

mutant(MCORE_GPT_SP, name="mutant-mcore-row-bias-flag-dropped",
       summary="the attention's row-parallel linear_proj.bias lost its sequence_parallel flag",
       bug="a row-parallel bias grad not all-reduced over TP under sequence parallelism (its output is "
           "reduce-scattered before the bias is added, so each rank's bias grad covers its own tokens only)",
       source="NVIDIA/Megatron-LM#236",
       shard=megatron_shard(CONFIG, edit_model=drop_sequence_parallel_flag(
           "decoder.layers.1.self_attention.linear_proj.bias")))

mutant(MCORE_GPT_SP, name="mutant-mcore-ddp-sync-only",
       summary="the training loop finishes grads with DDP's finish_grad_sync, not finalize_model_grads",
       bug="a training loop around megatron's DDP that syncs grads over DP only and never sums the "
           "sequence-parallel params' grads over TP",
       source="deepspeedai/DeepSpeed#4548",
       shard=megatron_shard(CONFIG, grad_sync="ddp"))
