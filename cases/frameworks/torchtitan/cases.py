"""Stage: config and step. torchtitan's built-in cases (registered where torchtitan is
installed): its llama3 with its own TP + SP sharding config at the run's TP, its qwen3 on its
spmd_types backend, the same model trained by torchtitan's own trainer step (`Trainer.train_step`,
clip_grad_norm_, OptimizersContainer), plan bugs expressed through torchtitan's own
`ShardingConfig` knobs and step bugs through its trainer's own slots."""

import dataclasses

from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.torchtitan.case import (
    torchtitan_case,
    torchtitan_cp_shard,
    torchtitan_shard,
    torchtitan_spmd_shard,
)
from sp_harness.cases.frameworks.torchtitan.step import TitanStepConfig, titan_step_shard, titan_train_case
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)
ISOLATION = "torchtitan"
"""torchtitan's process-wide state (its spmd backend switch, the CPU shim's module stand-in):
its cases share processes only with each other."""

TITAN_LLAMA3_SP = register(torchtitan_case(
    "titan-llama3-sp", SHAPES, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")), note="torchtitan llama3, TP 2 + SP"),
              Example(fields=(("world_size", 4), ("dtype", "float32")), note="torchtitan llama3, TP 4 + SP"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="torchtitan llama3, DP 2 x TP 2 + SP, its FSDP2 (apply_fsdp_to_decoder)"))))


def embedding_partial_declared_replicate(config) -> None:
    """The vocab-parallel embedding's output declared Replicate on TP where it is Partial: each
    rank's lookup holds only the rows of its vocab shard (zeros elsewhere), and with the source
    placement Replicate the reduce-scatter to the sequence shard becomes a local slice, so the
    partial lookups are never summed."""
    import spmd_types as spmd
    from torchtitan.models.common.decoder_sharding import dense_activation_placement

    config.tok_embeddings.sharding_config.out_src_shardings = dense_activation_placement(tp=spmd.R)


def norm_sequence_parallel_dropped(config) -> None:
    """Layer 0's ffn_norm left out of the plan (its sharding config gone) while SP is on: its
    weight stays a plain tensor, its input is the sequence-sharded DTensor."""
    config.layers[0].ffn_norm.sharding_config = None


mutant(TITAN_LLAMA3_SP, name="mutant-titan-embedding-partial-as-replicate",
       summary="tok_embeddings out_src_shardings TP: R where its vocab-parallel lookup is P",
       bug="a vocab-parallel embedding's partial per-rank lookups never summed over TP (declared replicated, "
           "so the reduce-scatter to the sequence shard is a local slice)",
       source="pytorch/torchtitan#3468",
       shard=torchtitan_shard(SHAPES, edit_sharding=embedding_partial_declared_replicate),
       killed_by=("forward", "even"))

mutant(TITAN_LLAMA3_SP, name="mutant-titan-norm-sp-dropped",
       summary="layers.0.ffn_norm has no sharding config under SP",
       bug="a norm's SequenceParallel style dropped from the TP plan: its plain weight meets the sequence-sharded "
           "DTensor activation",
       source="pytorch/pytorch#139681",
       shard=torchtitan_shard(SHAPES, edit_sharding=norm_sequence_parallel_dropped), killed_by=("crash", "even"))

mutant(TITAN_LLAMA3_SP, name="mutant-titan-fsdp-grads-summed-over-dp",
       summary="apply_fsdp_to_decoder's grad division left off under a per-replica mean loss",
       bug="grads summed over DP where the loss is each replica's mean (torchtitan turns FSDP's division off for "
           "its global-token loss scaling): DP times the grads, which AdamW's scale invariance hides from the "
           "loss and the params",
       source="pytorch/torchtitan#2323",
       shard=torchtitan_shard(SHAPES, fsdp_mean=False), killed_by=("grad", "dp2xtp2"))

QWEN3_SHAPES = dict(SHAPES, n_kv_heads=2)
"""qwen3 with GQA (2 kv heads for 4 query heads) and its flavors' tied embeddings."""

TITAN_QWEN3_SPMD_SP = register(torchtitan_case(
    "titan-qwen3-spmd-sp", QWEN3_SHAPES, model="qwen3", spmd_backend="spmd_types", isolation=ISOLATION,
    # float64 is Unsupported on this backend (its vocab-parallel loss is float32), so the battery's
    # entries run it in float32
    defaults=dict(dtype="float32"),
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="torchtitan qwen3 (GQA, QK norm, tied embeddings), spmd_types backend, TP 2 + SP"),
              Example(fields=(("world_size", 2), ("dtype", "bfloat16")),
                      note="torchtitan qwen3, spmd_types backend, TP 2 + SP, bfloat16"))))


def norm_declared_invariant_under_sp(config) -> None:
    """Layer 0's ffn_norm weight declared `I` on TP (its type without SP) while SP is on: the
    norm runs on the sequence shard, so each TP rank's weight grad is a partial sum, and a weight
    declared invariant is never all-reduced (the reduction is derived from the declared type). The
    config is layer 0's own copy: torchtitan shares one norm config between a layer's two norms."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    shared = config.layers[0].ffn_norm.sharding_config
    layout = shared.state_shardings["weight"]
    invariant = dataclasses.replace(layout, axis_types={**layout.axis_types, MeshAxisName.TP: spmd.I})
    config.layers[0].ffn_norm.sharding_config = dataclasses.replace(
        shared, state_shardings={**shared.state_shardings, "weight": invariant})


mutant(TITAN_QWEN3_SPMD_SP, name="mutant-titan-spmd-norm-declared-invariant",
       summary="spmd_types: layers.0.ffn_norm weight declared I on TP under SP, where its grad is partial (R)",
       bug="a sequence-parallel norm weight's per-rank partial grads never all-reduced over TP: under spmd_types "
           "the weight-grad all-reduce of an R-typed param is delayed to someone else (fully_shard), and a weight "
           "declared I gets none",
       source="NVIDIA/TransformerEngine#435 (norm weight grads under SP need a TP all-reduce outside the module); "
              "pytorch/pytorch#181519 (spmd_types' R convention: the weight-grad all-reduce left to the wrapper)",
       shard=torchtitan_spmd_shard(QWEN3_SHAPES, model="qwen3", edit_sharding=norm_declared_invariant_under_sp),
       killed_by=("grad", "even"))

mutant(TITAN_QWEN3_SPMD_SP, name="mutant-titan-spmd-embedding-partial-as-replicate",
       summary="spmd_types: tok_embeddings out_src_shardings TP: R where its vocab-parallel lookup is P",
       bug="the vocab-parallel embedding's partial per-rank lookups never summed over TP on the spmd_types backend "
           "(declared replicated, so the reduce-scatter to the sequence shard is a local slice)",
       source="pytorch/torchtitan#3468",
       shard=torchtitan_spmd_shard(QWEN3_SHAPES, model="qwen3", edit_sharding=embedding_partial_declared_replicate),
       killed_by=("forward", "even"))

TITAN_LLAMA3_CP = register(torchtitan_case(
    "titan-llama3-cp", SHAPES, context_parallel=2, isolation=ISOLATION,
    # CP runs over the whole world at DP 1 (world size 2), and torch's ring merges in float32, so
    # float64 is Unsupported: the battery's even entry runs it in float32
    defaults=dict(dtype="float32"),
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="torchtitan llama3, its context parallelism (SDPA ring, head-tail balancer) at CP 2, "
                           "through the CPU ring shim"),
              Example(fields=(("world_size", 2), ("dtype", "bfloat16")),
                      note="torchtitan llama3, CP 2, bfloat16"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "float32")),
                      note="torchtitan llama3, DP 2 x CP 2: FSDP2 over its fsdp axis (dp x cp flattened)"))))

CP_POSITIONS_NOT_SHARDED = mutant(
    TITAN_LLAMA3_CP, name="mutant-titan-cp-positions-not-sharded",
       summary="CP: RoPE positions not cut with the tokens (each rank rotates its shard by 0..s_r-1)",
       bug="under context parallelism the RoPE positions (torchtitan's freqs_cis, later its positions input) must be "
           "cut by the same load-balanced order as the tokens; a position buffer CP never shards leaves every rank "
           "rotating its tokens as if they began the sequence",
       source="pytorch/torchtitan#792 (freqs_cis of the PP stage models never handed to CP for sharding); "
              "pytorch/torchtitan#1797 (freqs_cis is order-sensitive under the CP load balancer)",
       shard=torchtitan_cp_shard(SHAPES, shard_positions=False), killed_by=("forward", "even"))

SFT = TokenLoss(masked_fraction=0.25, padding=2)
"""An SFT batch: a quarter of each sequence's labels and its 2 trailing pads at IGNORE_INDEX."""

TITAN_LLAMA3_SP_LOSS = register(torchtitan_case(
    "titan-llama3-sp-loss", SHAPES, loss=SFT, isolation=ISOLATION,
    # torchtitan's cross entropy is float32 (float64 Unsupported)
    defaults=dict(dtype="float32"),
    examples=(Example(fields=(("world_size", 2), ("dtype", "float32")),
                      note="torchtitan llama3, TP 2 + SP, its own vocab-parallel cross_entropy_loss over the valid "
                           "tokens of an SFT batch (loss mask, trailing padding)"),)))

mutant(TITAN_LLAMA3_SP_LOSS, name="mutant-titan-loss-counts-masked-tokens",
       summary="the loss divided by every label position, the masked and padded ones included",
       bug="a token-mean loss whose divisor counts labels at IGNORE_INDEX (labels.numel() where the trainer "
           "counts labels != -100): every step's loss and grads shrink by valid / all, a factor that moves with "
           "each batch's padding and prompt length",
       source="AI-Hypercomputer/maxtext#366 and EleutherAI/gpt-neo#45 (the fix: normalise by unpadded tokens); "
              "pytorch/torchtitan#4192 (the same two counts in torchtitan's trainer)",
       shard=torchtitan_shard(SHAPES, loss=SFT, count="all"), killed_by=("forward (loss)", "even"))

mutant(TITAN_LLAMA3_CP, name="mutant-titan-cp-fsdp-grads-summed-over-dp",
       summary="DP x CP: FSDP's grad division over its dp x cp axis left off under a per-replica mean loss",
       bug="grads summed over DP x CP where each replica's loss is its own mean (torchtitan turns FSDP's division "
           "off for its global-token loss scaling): DP times the grads",
       source="pytorch/torchtitan#2323 (the same double scaling in its DDP path after the switch to global-token "
              "loss scaling)",
       shard=torchtitan_cp_shard(SHAPES, fsdp_mean=False), killed_by=("grad", "dp2xtp2"))

TRAIN_STEP = (("train_step", True), ("micro_batches", 3), ("clip_grad_norm", 0.01), ("dtype", "float32"))
"""The training-step check's config the step case is shown on: K = 3 uneven micro-batches, clipping active."""

TITAN_LLAMA3_SP_STEP = register(titan_train_case(
    "titan-llama3-sp-step", SHAPES, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2), ("optimizer", "sgd"), *TRAIN_STEP),
                      note="torchtitan's own trainer step, TP 2 + SP, SGD, clipping active"),
              Example(fields=(("world_size", 4), ("dp", 2), ("optimizer", "adamw"), *TRAIN_STEP),
                      note="torchtitan's own trainer step, DP 2 (its FSDP2) x TP 2 + SP, AdamW, clipping active"))))

STEP_PER_MICRO_BATCH_MEAN = mutant(
    TITAN_LLAMA3_SP_STEP, name="mutant-titan-step-per-micro-batch-mean",
    summary="torchtitan's loss before #2206 in its trainer's loss_fn slot: each micro-batch's own token mean / K",
    bug="per-rank, per-micro-batch token weighting: each micro-batch's loss is the mean over its own valid "
        "tokens divided by the accumulation steps (RescaleAccumulatedLoss) and FSDP averages the grads over "
        "DP, so a micro-batch or replica with few valid tokens weighs as much as a full one; the trainer's "
        "0.3.0 loop and logging around it are unchanged. Caught at the reported loss",
    source="pytorch/torchtitan#2206 (fixes #1842)",
    shard=titan_step_shard(SHAPES, TitanStepConfig(per_micro_batch_mean=True)),
    train_loss=TITAN_LLAMA3_SP_STEP.train_loss, tags=("train-step",), killed_by=("reported loss", "train-step-f32"))

STEP_FSDP_DIVIDES_TWICE = mutant(
    TITAN_LLAMA3_SP_STEP, name="mutant-titan-step-fsdp-divides-twice",
    summary="FSDP's grad division over DP left on under torchtitan's global-token loss",
    bug="the loss is already divided by the global valid-token count (summed over DP), and the data-parallel "
        "wrapper still averages the grads over DP: every grad / DP, which AdamW's scale invariance hides "
        "from the loss (the DDP / HSDP path after #2206). Caught at the grads before clipping (dp > 1)",
    source="pytorch/torchtitan#2318 (fixed for DDP by #2323)",
    shard=titan_step_shard(SHAPES, TitanStepConfig(fsdp_grad_division=True)),
    train_loss=TITAN_LLAMA3_SP_STEP.train_loss, tags=("train-step",),
                                                killed_by=("grads before clipping", "train-step-f32"))

STEP_CLIP_NORM_LOCAL_SHARD = mutant(
    TITAN_LLAMA3_SP_STEP, name="mutant-titan-step-clip-norm-local-shard",
    summary="clip_grad_norm_'s norm over each rank's local grad pieces (to_local), never reduced over the ranks",
    bug="the grad norm computed over this rank's shards alone and never reduced over the ranks holding the "
        "others: each rank clips by its own pieces' norm (TP ranks by different coefficients), as torchtitan's "
        "norm missed the other pipeline stages' params before #649. Caught at the grad norm",
    source="pytorch/torchtitan#596 (fixed by #649)",
    shard=titan_step_shard(SHAPES, TitanStepConfig(norm_local_only=True)),
    train_loss=TITAN_LLAMA3_SP_STEP.train_loss, tags=("train-step",), killed_by=("grad norm", "train-step-f32"))
