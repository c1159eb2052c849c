"""Stage: build reference + sharded. torchtitan's built-in cases (registered where torchtitan is
installed): its llama3 with its own TP + SP sharding config at the run's TP, and plan bugs
expressed through torchtitan's own `ShardingConfig` knobs."""

from sp_harness.cases.frameworks.torchtitan import torchtitan_case, torchtitan_shard
from sp_harness.config.case import Example, mutant, register

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
       shard=torchtitan_shard(SHAPES, edit_sharding=embedding_partial_declared_replicate))

mutant(TITAN_LLAMA3_SP, name="mutant-titan-norm-sp-dropped",
       summary="layers.0.ffn_norm has no sharding config under SP",
       bug="a norm's SequenceParallel style dropped from the TP plan: its plain weight meets the sequence-sharded "
           "DTensor activation",
       source="pytorch/pytorch#139681",
       shard=torchtitan_shard(SHAPES, edit_sharding=norm_sequence_parallel_dropped))

mutant(TITAN_LLAMA3_SP, name="mutant-titan-fsdp-grads-summed-over-dp",
       summary="apply_fsdp_to_decoder's grad division left off under a per-replica mean loss",
       bug="grads summed over DP where the loss is each replica's mean (torchtitan turns FSDP's division off for "
           "its global-token loss scaling): DP times the grads, which AdamW's scale invariance hides from the "
           "loss and the params",
       source="pytorch/torchtitan#2323",
       shard=torchtitan_shard(SHAPES, fsdp_mean=False))
