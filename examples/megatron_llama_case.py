"""A Llama-style megatron-core 0.16.1 model (SwiGLU, RMSNorm, RoPE, GQA, tied embeddings, no biases)
with sequence parallelism, checked by sp-harness (pip install sp-harness[megatron]):

    sp-harness check --case examples/megatron_llama_case.py:LLAMA --world-size 2 --dtype bfloat16
    sp-harness check --case examples/megatron_llama_case.py:LLAMA_QK_NORM --world-size 2   # a user's layer spec
"""

import torch.nn.functional as F

from sp_harness.cases.frameworks.megatron import megatron_case

# SwiGLU: linear_fc1 is the fused [gate; up] weight, TP-split with megatron's partition_stride 2
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
              sequence_parallel=True)
# GPTModel's own arguments, given to the TP=1 reference and the sharded twin alike
GPT = dict(position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=True)

LLAMA = megatron_case("mcore-llama-sp-tp2", CONFIG, tp=2, gpt_kwargs=GPT)


def qk_norm_spec(tconfig):  # a layer spec of the user's: megatron's local spec with RMSNorm on queries and keys
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization=tconfig.normalization, qk_layernorm=tconfig.qk_layernorm)


# the config says qk_layernorm too: megatron-core 0.17+ refuses a spec's q/k norms the config does not enable
LLAMA_QK_NORM = megatron_case("mcore-llama-qk-norm-sp-tp2", {**CONFIG, "qk_layernorm": True}, tp=2, gpt_kwargs=GPT,
                              layer_spec=qk_norm_spec)
