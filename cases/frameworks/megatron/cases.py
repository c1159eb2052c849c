"""Stage: config and step. megatron-core's built-in cases (registered where
megatron-core is installed): its GPTModel with sequence parallelism at the run's TP, the same
model trained by megatron's own training step (schedule, finalize_model_grads, optimizer), and
the bugs SP users have shipped, expressed through megatron's own knobs."""

from typing import Any

import torch.nn.functional as F

from sp_harness.cases.frameworks.megatron.case import (
    drop_sequence_parallel_flag,
    flagged_attention_sinks,
    megatron_case,
    megatron_shard,
    partition_stride_one,
    router_counts_over_dp_group,
)
from sp_harness.cases.frameworks.megatron.cp import cp_kv_not_gathered, megatron_cp_shard
from sp_harness.cases.frameworks.megatron.module import cross_attention, megatron_module_case
from sp_harness.cases.frameworks.megatron.step import (
    MegatronStepConfig,
    drop_tensor_parallel_flag,
    megatron_step_shard,
    megatron_train_case,
)
from sp_harness.cases.frameworks.releases import ShippedBug, release_case
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

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
       shard=megatron_shard(CONFIG, edit_model=drop_sequence_parallel_flag("decoder.layers.0.input_layernorm.weight")),
       killed_by=("grad", "even"))

mutant(MCORE_GPT_SP, name="mutant-mcore-row-bias-flag-dropped",
       summary="the attention's row-parallel linear_proj.bias lost its sequence_parallel flag",
       bug="a row-parallel bias grad not all-reduced over TP under sequence parallelism (its output is "
           "reduce-scattered before the bias is added, so each rank's bias grad covers its own tokens only)",
       source="NVIDIA/Megatron-LM#236",
       shard=megatron_shard(CONFIG, edit_model=drop_sequence_parallel_flag(
           "decoder.layers.1.self_attention.linear_proj.bias")), killed_by=("grad", "even"))

mutant(MCORE_GPT_SP, name="mutant-mcore-ddp-sync-only",
       summary="the training loop finishes grads with DDP's finish_grad_sync, not finalize_model_grads",
       bug="a training loop around megatron's DDP that syncs grads over DP only and never sums the "
           "sequence-parallel params' grads over TP",
       source="deepspeedai/DeepSpeed#4548",
       shard=megatron_shard(CONFIG, grad_sync="ddp"), killed_by=("grad", "even"))

LOSS = TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2)
"""A user's loss and batch: a quarter of each sequence's labels out of the loss (loss_mask), 2 pad
tokens under the attention mask, label smoothing 0.1 in megatron's convention."""
PER_TOKEN = {**CONFIG, "calculate_per_token_loss": True}

MCORE_GPT_SP_LOSS = register(megatron_case(
    "mcore-gpt-sp-loss", PER_TOKEN, loss=LOSS, smoothing="global", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="megatron-core DP 2 x TP 2 + SP: loss mask, padding, label smoothing over the whole "
                           "vocabulary, finalize_model_grads dividing by the global valid-token count"),)))

mutant(MCORE_GPT_SP_LOSS, name="mutant-mcore-label-smoothing-local-vocab",
       summary="megatron's own vocab_parallel_cross_entropy(label_smoothing=0.1): the local vocab shard's statistics",
       bug="label smoothing at TP > 1 takes the mean log-probability and the vocabulary size from each rank's vocab "
           "shard, not the whole vocabulary: each TP rank's loss differs and the grads are wrong (megatron-core "
           "0.16.1's own code, unfixed upstream)",
       source="NVIDIA/Megatron-LM#7452 finding 1 (#7464, #737)",
       shard=megatron_shard(PER_TOKEN, loss=LOSS, smoothing="megatron"), killed_by=("forward (loss)", "even"))

LABELS = TokenLoss(masked_fraction=0.25, padding=2)
MCORE_GPT_SP_LABELS = register(megatron_case(
    "mcore-gpt-sp-labels", CONFIG, loss=LABELS, model_loss=True, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="megatron-core TP 2 + SP, GPTModel called with labels, pretrain_gpt's loss_mask"),)))

mutant(MCORE_GPT_SP_LABELS, name="mutant-mcore-gathered-logits-labels",
       summary="GPTModel with parallel_output=False called with labels: its vocab-parallel loss over gathered logits",
       bug="the output layer gathers the logits over TP (parallel_output=False) and compute_language_model_loss "
           "still calls the vocab-parallel cross entropy, which treats each rank's whole vocabulary as a shard: "
           "the loss is the true loss + log(TP) and the target term's grad is lost",
       source="NVIDIA/Megatron-LM#7452 finding 2",
       shard=megatron_shard(CONFIG, loss=LABELS, model_loss=True, vocab_parallel_loss=False),
       killed_by=("forward", "even"))

XATTN = dict(num_layers=1, hidden_size=32, num_attention_heads=4, sequence_parallel=True)
XATTN_IO: dict[str, Any] = dict(inputs=("hidden_states", "key_value_states"), constants={"attention_mask": None})
"""megatron's CrossAttention alone, built with an explicit pg_collection: queries from
`hidden_states`, keys and values from `key_value_states`, both sequence-parallel."""

MCORE_XATTN_SP = register(megatron_module_case(
    "mcore-xattn-sp", XATTN, build=cross_attention(fixed=True), isolation=ISOLATION, **XATTN_IO,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="megatron-core CrossAttention with an explicit pg_collection, DP 2 x TP 2 + SP, "
                           "megatron's global TP groups laid across DP"),)))

mutant(MCORE_XATTN_SP, name="mutant-mcore-xattn-global-tp-group",
       summary="megatron-core 0.16.1's CrossAttention: linear_q / linear_kv built without its pg_collection's tp_group",
       bug="CrossAttention passes no tp_group to its column-parallel linear_q and linear_kv, so they fall back to "
           "megatron's global TP group: with an explicit pg_collection on other ranks, their sequence all-gather "
           "and grad reductions run over the wrong ranks (megatron-core 0.16.1's own code)",
       source="NVIDIA/Megatron-LM#7452 finding 6",
       shard=megatron_module_case("mcore-xattn-sp", XATTN, build=cross_attention(fixed=False), **XATTN_IO).shard,
       killed_by=("forward", "dp2xtp2"))

LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
             sequence_parallel=True)
"""A Llama-style block: SwiGLU (a fused [gate; up] fc1 split with partition_stride 2), RMSNorm, GQA,
no biases; with `LLAMA_GPT`'s RoPE and tied embeddings."""
LLAMA_GPT = dict(position_embedding_type="rope", share_embeddings_and_output_weights=True)

MCORE_LLAMA_SP = register(megatron_case(
    "mcore-llama-sp", LLAMA, gpt_kwargs=LLAMA_GPT, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="megatron-core Llama-style (SwiGLU, RMSNorm, RoPE, GQA, tied embeddings), TP 2 + SP"),)))

mutant(MCORE_LLAMA_SP, name="mutant-mcore-llama-final-norm-flag-dropped",
       summary="the Llama model's final_layernorm.weight lost its sequence_parallel flag",
       bug="final_layernorm's grad under TP + SP not summed over TP: each TP rank keeps the grad of its own "
           "sequence shard, and the replicas' main_grads differ before the optimizer step",
       source="NVIDIA/Megatron-LM#1446",
       shard=megatron_shard(LLAMA, gpt_kwargs=LLAMA_GPT,
                            edit_model=drop_sequence_parallel_flag("decoder.final_layernorm.weight")),
       killed_by=("grad", "even"))

mutant(MCORE_LLAMA_SP, name="mutant-mcore-llama-swiglu-contiguous-split",
       summary="a SwiGLU fc1 split into contiguous TP chunks (partition_stride 1), not [gate; up] chunk by chunk",
       bug="the fused [gate; up] fc1 weight TP-split as one matrix: TP rank 0 holds gate rows only and its local "
           "chunk(2) pairs gate with gate, rank 1 up with up (SwiGLU wrong at TP > 1)",
       source="NVIDIA/Megatron-LM#360",
       shard=megatron_shard(LLAMA, gpt_kwargs=LLAMA_GPT,
                            edit_params=partition_stride_one("decoder.layers.0.mlp.linear_fc1.weight")),
       killed_by=("forward", "even"))

MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, add_bias_linear=False,
           gated_linear_unit=True, activation_func=F.silu, num_moe_experts=4, moe_router_topk=2,
           moe_aux_loss_coeff=0.01, sequence_parallel=True)
"""A mixture of experts: top-2 routing over 4 SwiGLU experts (megatron's SequentialMLP, TP-sharded,
expert parallel 1) with the load-balancing loss."""

MCORE_MOE_SP = register(megatron_case(
    "mcore-moe-sp", MOE, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="megatron-core MoE (top-2 of 4 SwiGLU experts, load-balancing loss), TP 2 + SP"),)))

mutant(MCORE_MOE_SP, name="mutant-mcore-moe-router-counts-over-dp",
       summary="the MoE router reduces its per-expert token counts over the DP group, not TP x CP",
       bug="the router's token counts all-reduced over the wrong group: under SP each TP rank routes its own "
           "sequence shard, and the load-balancing loss counts one shard's tokens as the batch's",
       source="NVIDIA/Megatron-LM#7452 finding 10",
       shard=megatron_shard(MOE, edit_model=router_counts_over_dp_group()), killed_by=("grad", "even"))

TRAIN_STEP = (("train_step", True), ("micro_batches", 3), ("clip_grad_norm", 0.01), ("dtype", "float32"))
"""The training-step check's config the step cases are shown on: K = 3 uneven micro-batches,
clipping active."""

MCORE_GPT_SP_STEP = register(megatron_train_case(
    "mcore-gpt-sp-step", CONFIG, isolation=ISOLATION, baseline=MCORE_GPT_TP.name,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), ("optimizer", "sgd"), *TRAIN_STEP),
                      note="megatron's own training step, DP 2 x TP 2 + SP, SGD, clipping active"),
              Example(fields=(("world_size", 2), ("optimizer", "adamw"), *TRAIN_STEP),
                      note="megatron's own training step, TP 2 + SP, AdamW, clipping active"))))

MCORE_GPT_SP_STEP_DISTOPT = register(megatron_train_case(
    "mcore-gpt-sp-step-distopt", CONFIG, step=MegatronStepConfig(use_distributed_optimizer=True),
    isolation=ISOLATION, baseline=MCORE_GPT_TP.name,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), ("optimizer", "adamw"), *TRAIN_STEP),
                      note="megatron's own step with its distributed optimizer (grads reduce-scattered, "
                           "Adam over DP shards), DP 2 x TP 2 + SP"),)))

mutant(MCORE_GPT_SP_STEP, name="mutant-mcore-step-local-token-mean",
       summary="megatron's calculate_per_token_loss=False: each micro-batch and DP replica normalised by its own tokens",
       bug="each rank's loss divided by its own valid-token count (per micro-batch, then by K) and the grads "
           "averaged over DP, where the case means the token mean over the global batch: megatron's legacy "
           "normalisation, the same local-count bug as context-parallel ranks normalising by their own tokens "
           "(here at DP; at CP: release-mcore-7452-f9-cp-local-token-count). The logged "
           "loss stays the token mean. Caught at the grads before clipping",
       source="NVIDIA/Megatron-LM#7452 finding 9 (CP ranks normalise by their local token count; PR #7513)",
       shard=megatron_step_shard(CONFIG, MegatronStepConfig(calculate_per_token_loss=False)),
       train_loss=MCORE_GPT_SP_STEP.train_loss, tags=("train-step",),
                                                killed_by=("grads before clipping", "train-step"))

mutant(MCORE_GPT_SP_STEP, name="mutant-mcore-step-clip-norm-tp-rank0",
       summary="a head-sharded param without megatron's tensor_model_parallel flag: the clip norm counts TP rank 0's shard",
       bug="megatron's grad norm keeps a param's grad on every TP rank only if it is flagged tensor_model_parallel "
           "(param_is_not_tensor_parallel_duplicate), else on TP rank 0 alone: the attention's head-sharded qkv "
           "bias, unflagged, loses its other shards from the norm and the clip coefficient, as the learnable "
           "attention sinks' softmax_offset did. Caught at the grad norm",
       source="NVIDIA/Megatron-LM#7452 finding 8 (PR #7530)",
       shard=megatron_step_shard(CONFIG, edit_model=drop_tensor_parallel_flag(
           "decoder.layers.1.self_attention.linear_qkv.bias")),
       train_loss=MCORE_GPT_SP_STEP.train_loss, tags=("train-step",), killed_by=("grad norm", "train-step"))

CP = dict(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2, calculate_per_token_loss=True)
"""megatron's own context parallelism at TP 1 (megatron/cp.py): its load-balanced split, K/V all-gathered
over its CP group by the exact CPU stand-in for TransformerEngine's CP attention, its DDP over DP x CP."""
CP_STEP = (("world_size", 4), ("dp", 2), ("optimizer", "sgd"), *TRAIN_STEP)
"""DP 2 x CP 2, K = 3 uneven micro-batches (the last CP rank of the last replica holds no valid token)."""

MCORE_GPT_CP = register(megatron_case(
    "mcore-gpt-cp", CP, tp=1, isolation=ISOLATION,
    # CP 2 alone (float64 too) is the battery's even entry for its mutant's twin (tests/test_mutants.py)
    examples=(Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="megatron-core DP 2 x CP 2 (TP 1): get_batch_on_this_cp_rank, K/V all-gathered over its "
                           "CP group, its DDP and finalize_model_grads over DP x CP"),)))

mutant(MCORE_GPT_CP, name="mutant-mcore-cp-kv-not-gathered",
       summary="CP attention without its K/V exchange: each CP rank's queries attend to its own chunks only",
       bug="context-parallel attention run on each rank's local K/V (causal by global position), as TransformerEngine's "
           "attention runs when its CP group was never set: every query misses the keys of the other ranks' chunks",
       source="NVIDIA/Megatron-LM megatron/core/extensions/transformer_engine.py (TEDotProductAttention: cp_group is "
              "None until set_context_parallel_group is called)",
       shard=megatron_cp_shard(CP, attention=cp_kv_not_gathered), killed_by=("forward", "even"))

MCORE_GPT_CP_STEP = register(megatron_train_case(
    "mcore-gpt-cp-step", CP, tp=1, isolation=ISOLATION,
    examples=(Example(fields=CP_STEP, note="megatron's own step at DP 2 x CP 2, calculate_per_token_loss=True: the "
                                           "control of release-mcore-7452-f9-cp-local-token-count"),)))

# every release from the range's oldest (compat.RELEASES: 0.15.0) to the newest (0.19.2, read in its wheel)
# divides the legacy 3-tuple loss by each CP rank's own count (schedules.forward_step_calc_loss); the fix (PR
# #7513) is unmerged: `fixed` is None, which the release matrix re-checks when a release ships
BUG_7452_F9 = ShippedBug(
    distribution="megatron-core", first="0.15.0", fixed=None, stage="grads before clipping",
    summary="context parallelism, calculate_per_token_loss=False: each CP rank's loss sum divided by its own "
            "valid-token count, the grads then averaged over DP x CP, so uneven counts across CP ranks change "
            "the objective (0.500x the grads at CP 2 when one rank holds every valid token)",
    source="https://github.com/NVIDIA/Megatron-LM/issues/7452 (finding 9; fix proposed in PR #7513)")
RELEASE_7452_F9 = release_case(
    megatron_train_case("mcore-gpt-cp-step-legacy", {**CP, "calculate_per_token_loss": False}, tp=1,
                        isolation=ISOLATION),
    name="release-mcore-7452-f9-cp-local-token-count", bug=BUG_7452_F9, fields=CP_STEP,
    note="megatron's own step at DP 2 x CP 2, its legacy normalisation (calculate_per_token_loss=False)")

SINKS = {**CONFIG, "softmax_type": "learnable"}
"""Learnable attention sinks: `softmax_offset`, one per head, head-sharded over TP."""
SINKS_STEP = (("world_size", 2), ("optimizer", "sgd"), *TRAIN_STEP)
MCORE_GPT_SP_STEP_SINKS = register(megatron_train_case(
    "mcore-gpt-sp-step-sinks", SINKS, layer_spec=flagged_attention_sinks(), isolation=ISOLATION,
    examples=(Example(fields=SINKS_STEP, note="megatron's own step, learnable attention sinks flagged tensor-parallel "
                                              "as PR #7530 does: the control of release-mcore-7452-f8-sinks-clip-norm"),)))
# unfixed in every release to the newest (0.19.2's DotProductAttention, read in its wheel): `fixed` is None,
# which the release matrix re-checks when a release ships
BUG_7452_F8 = ShippedBug(
    distribution="megatron-core", first="0.15.0", fixed=None, stage="grad norm",
    summary="learnable attention sinks (softmax_type='learnable'): softmax_offset is head-sharded over TP but not "
            "flagged tensor_model_parallel, so the clip norm counts TP rank 0's sinks alone",
    source="https://github.com/NVIDIA/Megatron-LM/issues/7452 (finding 8; fix proposed in PR #7530)")
RELEASE_7452_F8 = release_case(
    megatron_train_case("mcore-gpt-sp-step-sinks-unflagged", SINKS, isolation=ISOLATION),
    name="release-mcore-7452-f8-sinks-clip-norm", bug=BUG_7452_F8, fields=SINKS_STEP,
    note="megatron's own step at TP 2 + SP, learnable attention sinks as megatron builds them (unflagged)")
