"""megatron-core's own context parallelism (pip install sp-harness[megatron]): CP 2 at megatron TP 1, its
load-balanced split, K/V all-gathered over the CP group (TransformerEngine's CP attention's exact CPU stand-in):

    sp-harness check --case examples/megatron_cp_case.py:GPT_CP --world-size 4 --dp 2 --dtype float32
    sp-harness check --case examples/megatron_cp_case.py:GPT_CP_STEP --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer sgd --clip-grad-norm 0.01
    sp-harness check --case examples/megatron_cp_case.py:GPT_CP_STEP --train-step --micro-batches 3 --world-size 4 --dp 2 --optimizer adamw --clip-grad-norm 0.01 --dtype bfloat16
"""

from sp_harness.cases.frameworks.megatron import megatron_case, megatron_train_case

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2,
              calculate_per_token_loss=True)

GPT_CP = megatron_case("mcore-gpt-cp2", CONFIG, tp=1, isolation="megatron-core")
GPT_CP_STEP = megatron_train_case("mcore-gpt-cp2-step", CONFIG, tp=1, isolation="megatron-core")
