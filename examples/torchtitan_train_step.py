"""torchtitan 0.3.0's own trainer step (Trainer.train_step: gradient accumulation, the loss over
the global valid-token count, clip_grad_norm_, its OptimizersContainer) on its llama3 under its
TP + SP plan (and FSDP2 at --dp 2), under the training-step check (pip install sp-harness[torchtitan]):

    sp-harness check --case examples/torchtitan_train_step.py:LLAMA3_SP_STEP --train-step --micro-batches 3 --world-size 2 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/torchtitan_train_step.py:LLAMA3_SP_STEP --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer adamw --clip-grad-norm 0.01 --dtype bfloat16
    sp-harness check --case examples/torchtitan_train_step.py:PER_MICRO_BATCH_MEAN --train-step --micro-batches 3 --world-size 2 --optimizer sgd --clip-grad-norm 0.01   # FAILs at loss
    sp-harness check --case examples/torchtitan_train_step.py:FSDP_DIVIDES_TWICE --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01   # FAILs at grad
    sp-harness check --case examples/torchtitan_train_step.py:CLIP_NORM_LOCAL_SHARD --train-step --micro-batches 3 --world-size 2 --optimizer sgd --clip-grad-norm 0.01   # FAILs at grad_norm
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.torchtitan import TitanStepConfig, titan_step_shard, titan_train_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

LLAMA3_SP_STEP = titan_train_case("titan-llama3-sp-step-tp2", SHAPES, tp=2)

# pytorch/torchtitan#2206 undone: each micro-batch's own token mean / K, FSDP averaging over DP
PER_MICRO_BATCH_MEAN = mutant(
    LLAMA3_SP_STEP, name="mutant-titan-step-per-micro-batch-mean-tp2", summary="loss_fn: micro-batch mean / K",
    bug="per-rank, per-micro-batch token weighting", source="pytorch/torchtitan#2206",
    shard=titan_step_shard(SHAPES, TitanStepConfig(per_micro_batch_mean=True)), train_loss=LLAMA3_SP_STEP.train_loss)
# pytorch/torchtitan#2318: FSDP's division over DP left on under the global-token loss
FSDP_DIVIDES_TWICE = mutant(
    LLAMA3_SP_STEP, name="mutant-titan-step-fsdp-divides-twice-tp2", summary="FSDP divide factor DP",
    bug="grads divided by DP twice", source="pytorch/torchtitan#2318",
    shard=titan_step_shard(SHAPES, TitanStepConfig(fsdp_grad_division=True)), train_loss=LLAMA3_SP_STEP.train_loss)
# pytorch/torchtitan#596 (fixed by #649): the clip norm's DTensor partial never reduced over the ranks
CLIP_NORM_LOCAL_SHARD = mutant(
    LLAMA3_SP_STEP, name="mutant-titan-step-clip-norm-local-shard-tp2", summary="norm over to_local() grads",
    bug="each rank clips by its own shards' norm", source="pytorch/torchtitan#596",
    shard=titan_step_shard(SHAPES, TitanStepConfig(norm_local_only=True)), train_loss=LLAMA3_SP_STEP.train_loss)
