"""megatron-core 0.16.1 with sequence parallelism, checked by sp-harness (pip install sp-harness[megatron]):

    sp-harness check --case examples/megatron_core_case.py:GPT_SP_TP2 --world-size 2
    sp-harness check --case examples/megatron_core_case.py:GPT_SP_TP4 --world-size 4
    sp-harness check --case examples/megatron_core_case.py:GPT_SP_TP2_MASKED --world-size 4 --dp 2
    sp-harness check --case examples/megatron_core_case.py:NORM_FLAG_DROPPED --world-size 2   # FAILs at grad
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.megatron import drop_sequence_parallel_flag, megatron_case, megatron_shard
from sp_harness.cases.frameworks.token_loss import TokenLoss

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, sequence_parallel=True)

GPT_SP_TP2 = megatron_case("mcore-gpt-sp-tp2", CONFIG, tp=2)
GPT_SP_TP4 = megatron_case("mcore-gpt-sp-tp4", CONFIG, tp=4)
# logits gathered by megatron, loss in the run dtype: no float32 island, so it PASSes at float64 too
GPT_SP_TP2_GATHERED = megatron_case("mcore-gpt-sp-tp2-gathered", CONFIG, tp=2, vocab_parallel_loss=False)

# a loss mask and 2 pad tokens per sequence, each DP replica's loss normalised by its own valid tokens
# (calculate_per_token_loss=False): the generated batch holds the same count in every sequence
GPT_SP_TP2_MASKED = megatron_case("mcore-gpt-sp-tp2-masked", CONFIG, tp=2, loss=TokenLoss(masked_fraction=0.25, padding=2))

# GPT-NeoX #1257 through megatron's own knob: a norm param that lost its `sequence_parallel`
# flag, so finalize_model_grads never sums its grad over TP
NORM_FLAG_DROPPED = mutant(
    GPT_SP_TP2, name="mutant-mcore-norm-flag-dropped", summary="input_layernorm.weight lost its sequence_parallel flag",
    bug="a LayerNorm param's grad not all-reduced over TP under sequence parallelism", source="EleutherAI/gpt-neox#1257",
    shard=megatron_shard(CONFIG, edit_model=drop_sequence_parallel_flag("decoder.layers.0.input_layernorm.weight")))
