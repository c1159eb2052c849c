"""yunchang 0.6.4's LongContextAttention (USP: Ulysses x ring), checked by sp-harness
(pip install sp-harness[yunchang]):

    sp-harness check --case examples/yunchang_case.py:USP_2X2 --world-size 4
    sp-harness check --case examples/yunchang_case.py:RING_ZIGZAG --world-size 2 --dtype bfloat16
    sp-harness check --case examples/yunchang_case.py:CONTIGUOUS_INTO_ZIGZAG --world-size 2   # FAILs at forward
    sp-harness check --case examples/yunchang_case.py:BASIC_ULYSSES_HIGH --world-size 4 --forward-only yes  # FAILs
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.yunchang import ulysses_case, usp_case, yunchang_shard

# ulysses 2 x ring 2 over 4 ranks, yunchang's zigzag ring, tokens placed by its EXTRACT_FUNC_DICT
USP_2X2 = usp_case("yc-usp-2x2", ulysses_degree=2, ring_degree=2, ring_impl_type="zigzag")
RING_ZIGZAG = usp_case("yc-ring-zigzag", ulysses_degree=1, ring_impl_type="zigzag")
# yunchang's default ring ("basic"); with set_seq_parallel_pg(use_ulysses_low=False) its own
# basic_extract_local places the tokens for the other group layout (a finding)
RING_BASIC = usp_case("yc-ring-basic", ulysses_degree=1, ring_impl_type="basic")
BASIC_ULYSSES_HIGH = usp_case("yc-basic-ulysses-high", ring_impl_type="basic", use_ulysses_low=False)

# long-context-attention#53: a zigzag ring fed contiguous shards
CONTIGUOUS_INTO_ZIGZAG = mutant(
    RING_ZIGZAG, name="mutant-yc-zigzag-contiguous", summary="zigzag ring fed contiguous shards",
    bug="input sharded by basic_extract_local under the zigzag ring", source="feifeibear/long-context-attention#53",
    shard=yunchang_shard(ring_impl_type="zigzag", extract="basic"))

# yunchang's torch math attention (AttnType.TORCH_MATH; forward only: yunchang gives it no backward)
USP_TORCH_MATH = usp_case("yc-usp-torch-math", attn_type="torch_math")
ULYSSES_TORCH_MATH = ulysses_case("yc-ulysses-torch-math", attn_type="torch_math")  # UNSUPPORTED on CPU
FA3 = usp_case("yc-usp-fa3", attn_type="fa3")  # UNSUPPORTED on CPU: flash-attn 3's Hopper kernels
