"""A megatron-core 0.16.1 mixture-of-experts model (top-2 router over 4 SwiGLU experts, megatron's
SequentialMLP, experts TP-sharded, expert parallel 1) with sequence parallelism, checked by
sp-harness (pip install sp-harness[megatron]):

    sp-harness check --case examples/megatron_moe_case.py:MOE --world-size 2 --dtype bfloat16
"""

import torch.nn.functional as F

from sp_harness.cases.frameworks.megatron import megatron_case

# expert biases need expert TP 1 in megatron: none here, as in Mixtral
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, add_bias_linear=False,
              gated_linear_unit=True, activation_func=F.silu, num_moe_experts=4, moe_router_topk=2,
              moe_aux_loss_coeff=0.01, sequence_parallel=True)

MOE = megatron_case("mcore-moe-sp-tp2", CONFIG, tp=2)
