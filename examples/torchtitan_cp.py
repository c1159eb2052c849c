"""torchtitan 0.3.0's context parallelism (its torchtitan.distributed.context_parallel) on llama3,
as a case (pip install sp-harness[torchtitan]):

    sp-harness check --case examples/torchtitan_cp.py:LLAMA3_CP2 --world-size 2 --dtype float32

On CPU this is UNSUPPORTED before any rank starts, with the reason torch gives (measured on 2 gloo
ranks, torch 2.13.0): for SDPA, torchtitan's apply_cp_to_forward hands q/k/v to torch's CP
dispatcher as DTensors, and no CPU SDPA kernel has a sharding strategy there; its FlexAttention CP
all-gathers K/V for flex_attention, which has no CPU backward. docs/frameworks/torchtitan.md.
"""

from sp_harness.cases.frameworks.torchtitan import torchtitan_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

LLAMA3_CP2 = torchtitan_case("titan-llama3-cp2", SHAPES, tp=1, context_parallel=2)
