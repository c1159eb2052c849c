"""DeepSpeed's own engine training step (deepspeed.initialize, engine.backward and
engine.step per micro-batch, ZeRO, CPU optimizer offload, gradient clipping) around its Ulysses
DistributedAttention, checked stage by stage by sp-harness's training-step check:

    sp-harness check --case examples/deepspeed_train_step.py:ZERO2 --train-step --micro-batches 3 \
        --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/deepspeed_train_step.py:OFFLOAD --train-step --micro-batches 3 \
        --world-size 2 --optimizer adamw --dtype bfloat16
    sp-harness check --case examples/deepspeed_train_step.py:PLAIN --train-step --micro-batches 3 --world-size 2
    sp-harness check --case examples/deepspeed_train_step.py:DROPPED --train-step --micro-batches 3 \
        --world-size 2 --optimizer sgd --clip-grad-norm 0.01          # FAILs at grads before clipping
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.deepspeed import DeepSpeedStepConfig, ds_step_case, ds_step_shard

PLAIN = ds_step_case("my-ds-step", {"zero_optimization": {"stage": 0}})
ZERO2 = ds_step_case("my-ds-step-zero2", {"zero_optimization": {"stage": 2}})
CPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
OFFLOAD = ds_step_case("my-ds-step-offload", CPU)
ZERO1_OFFLOAD = ds_step_case("my-ds-step-zero1-offload", {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
# DeepSpeed 0.15.2-0.18.x: ZeRO-Offload with GA >= 3 lost the middle micro-batches' grads
DROPPED = mutant(OFFLOAD, name="mutant-my-ds-offload-drops-middle", summary="DeepSpeed before #7967",
                 bug="micro-batches 1..K-2 never reach the CPU-offloaded grads", source="deepspeedai/DeepSpeed#7967",
                 shard=ds_step_shard(CPU, DeepSpeedStepConfig(regress=("7967",))), train_loss=OFFLOAD.train_loss)
