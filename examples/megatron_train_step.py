"""megatron-core 0.16.1's own training step (schedule, finalize_model_grads, clipping, optimizer)
under the training-step check (pip install sp-harness[megatron]):

    sp-harness check --case examples/megatron_train_step.py:GPT_SP_STEP --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/megatron_train_step.py:GPT_SP_STEP_DISTOPT --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer adamw --clip-grad-norm 0.01 --dtype bfloat16
    sp-harness check --case examples/megatron_train_step.py:GPT_SP_STEP_SMOOTHED --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/megatron_train_step.py:LOCAL_TOKEN_MEAN --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01   # FAILs at grad
    sp-harness check --case examples/megatron_train_step.py:CLIP_NORM_TP_RANK0 --train-step --micro-batches 3 --world-size 2 --optimizer sgd --clip-grad-norm 0.01   # FAILs at grad_norm
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.megatron import step as ms
from sp_harness.cases.frameworks.token_loss import TokenLoss

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, sequence_parallel=True)

# isolation: rank processes shared with megatron-core's other cases (and these mutants), which set its globals alike
GPT_SP_STEP = ms.megatron_train_case("mcore-gpt-sp-step-tp2", CONFIG, tp=2, isolation="megatron-core")
GPT_SP_STEP_DISTOPT = ms.megatron_train_case("mcore-gpt-sp-step-distopt-tp2", CONFIG, tp=2, isolation="megatron-core",
                                             step=ms.MegatronStepConfig(use_distributed_optimizer=True))
# label smoothing over the whole vocabulary (Megatron-LM #7466) in the loss of megatron's own step, 2 pad tokens
GPT_SP_STEP_SMOOTHED = ms.megatron_train_case("mcore-gpt-sp-step-smoothed-tp2", CONFIG, tp=2, isolation="megatron-core",
                                              loss=TokenLoss(label_smoothing=0.1, padding=2), smoothing="global")

# Megatron-LM#7452 finding 9 at DP: each micro-batch and replica normalised by its own token count
LOCAL_TOKEN_MEAN = mutant(
    GPT_SP_STEP, name="mutant-mcore-step-local-token-mean", summary="calculate_per_token_loss=False",
    bug="each rank's loss normalised by its own valid tokens", source="NVIDIA/Megatron-LM#7452 finding 9 (PR #7513)",
    shard=ms.megatron_step_shard(CONFIG, ms.MegatronStepConfig(calculate_per_token_loss=False)),
    train_loss=GPT_SP_STEP.train_loss)
# Megatron-LM#7452 finding 8: a head-sharded param without its tensor_model_parallel flag, half missing from the norm
CLIP_NORM_TP_RANK0 = mutant(
    GPT_SP_STEP, name="mutant-mcore-step-clip-norm-tp-rank0", summary="qkv bias unflagged: its norm on TP rank 0 only",
    bug="a TP-split param's grad counted on TP rank 0 alone in the clip norm", source="NVIDIA/Megatron-LM#7452 finding 8 (PR #7530)",
    shard=ms.megatron_step_shard(CONFIG, edit_model=ms.drop_tensor_parallel_flag("decoder.layers.1.self_attention.linear_qkv.bias")),
    train_loss=GPT_SP_STEP.train_loss)
