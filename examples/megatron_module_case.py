"""Any megatron-core MegatronModule built with an explicit pg_collection, checked by sp-harness
(pip install sp-harness[megatron]); megatron's global TP groups are laid out across DP, so a layer
that reads them instead of its pg_collection FAILs at DP > 1:

    sp-harness check --case examples/megatron_module_case.py:XATTN --world-size 4 --dp 2                # PASS
    sp-harness check --case examples/megatron_module_case.py:XATTN_MEGATRON --world-size 4 --dp 2       # FAIL
"""

from sp_harness.cases.frameworks.megatron import cross_attention, megatron_module_case

CONFIG = dict(num_layers=1, hidden_size=32, num_attention_heads=4, sequence_parallel=True)
INPUTS = ("hidden_states", "key_value_states")  # [s, b, h] each, sequence-parallel

# megatron's CrossAttention with its projections built on the module's own TP group (the fix of PR #7190)
XATTN = megatron_module_case("mcore-xattn-tp2", CONFIG, build=cross_attention(fixed=True), inputs=INPUTS,
                             constants={"attention_mask": None}, tp=2)
# megatron-core 0.16.1's own: linear_q / linear_kv on megatron's global TP group (#7452 finding 6)
XATTN_MEGATRON = megatron_module_case("mcore-xattn-megatron-tp2", CONFIG, build=cross_attention(fixed=False),
                                      inputs=INPUTS, constants={"attention_mask": None}, tp=2)
