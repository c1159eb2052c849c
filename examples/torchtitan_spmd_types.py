"""torchtitan 0.3.0's llama3 on its spmd_types backend (parallelism.spmd_backend="spmd_types"),
TP 2 + SP and TP 2 alone, checked by sp-harness (pip install sp-harness[torchtitan]):

    sp-harness check --case examples/torchtitan_spmd_types.py:LLAMA3_SPMD_SP --world-size 2 --dtype float32
    sp-harness check --case examples/torchtitan_spmd_types.py:LLAMA3_SPMD_SP --world-size 2 --dtype bfloat16
    sp-harness check --case examples/torchtitan_spmd_types.py:LLAMA3_SPMD_TP --world-size 2 --dtype float32
"""

from sp_harness.cases.frameworks.torchtitan import torchtitan_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

LLAMA3_SPMD_SP = torchtitan_case("titan-llama3-spmd-sp-tp2", SHAPES, tp=2, spmd_backend="spmd_types")
LLAMA3_SPMD_TP = torchtitan_case("titan-llama3-spmd-tp2", SHAPES, tp=2, enable_sp=False, spmd_backend="spmd_types")
