"""torchtitan 0.3.0's context parallelism (torchtitan.distributed.context_parallel) on llama3, as
a case (pip install sp-harness[torchtitan]):

    sp-harness check --case examples/torchtitan_cp.py:LLAMA3_CP2 --world-size 2 --dtype float32    # PASS
    sp-harness check --case examples/torchtitan_cp.py:LLAMA3_CP2 --world-size 2 --dtype bfloat16   # PASS

torchtitan's own CP path for SDPA (apply_cp_to_forward, prepare_context_parallel_input with its
head-tail load balancer, apply_fsdp_to_decoder on the CP mesh) at CP 2; torch's ring attention
reaches the CPU kernel through the opt-in shim sp_harness.cases.frameworks.cp_cpu_ring (its
docstring: what CUDA does, what the shim changes, why the math is the same).
docs/frameworks/torchtitan.md#context-parallelism.
"""

from sp_harness.cases.frameworks.torchtitan import torchtitan_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

LLAMA3_CP2 = torchtitan_case("titan-llama3-cp2", SHAPES, context_parallel=2)
LLAMA3_GQA_CP2 = torchtitan_case("titan-llama3-gqa-cp2", dict(SHAPES, n_kv_heads=2), context_parallel=2)
