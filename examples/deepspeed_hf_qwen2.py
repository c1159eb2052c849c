"""DeepSpeed 0.19.8's UlyssesSPAttentionHF (Arctic long-sequence training) on an HF Qwen2, checked by sp-harness:

    sp-harness check --case examples/deepspeed_hf_qwen2.py:QWEN2 --world-size 2                      # PASS
    sp-harness check --case examples/deepspeed_hf_qwen2.py:QWEN2 --world-size 4 --dp 2 --dtype bfloat16
    sp-harness check --case examples/deepspeed_hf_qwen2.py:QWEN2_F64 --world-size 2 --dtype float64
"""

from sp_harness.cases.frameworks.deepspeed import hf_ulysses_case

# Qwen2Config keywords (its shapes become the case's defaults: --hidden, --num-heads, ... override them)
MY_QWEN2 = dict(num_key_value_heads=2, rope_theta=10000.0)
QWEN2 = hf_ulysses_case("my-ds-hf-qwen2", MY_QWEN2, model_type="qwen2")  # DeepSpeed's engine syncs grads
QWEN2_ZERO2 = hf_ulysses_case("my-ds-hf-qwen2-zero2", MY_QWEN2, model_type="qwen2",
                              ds_config={"zero_optimization": {"stage": 2}})
# float64: DeepSpeed's engine reduces no float64 grad, so its sums are written out
QWEN2_F64 = hf_ulysses_case("my-ds-hf-qwen2-f64", MY_QWEN2, model_type="qwen2", grad_sync="all-reduce")
