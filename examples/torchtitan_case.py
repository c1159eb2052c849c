"""torchtitan 0.3.0's llama3 under its own TP + SP sharding config, checked by sp-harness
(pip install sp-harness[torchtitan]):

    sp-harness check --case examples/torchtitan_case.py:LLAMA3_SP_TP2 --world-size 2
    sp-harness check --case examples/torchtitan_case.py:LLAMA3_SP_TP4 --world-size 4
    sp-harness check --case examples/torchtitan_case.py:QWEN3_SP_TP2 --world-size 2 --dtype float32   # qwen3
    sp-harness check --case examples/torchtitan_case.py:DSV3_SP_TP2 --world-size 2 --dtype float32    # deepseek_v3
    sp-harness check --case examples/torchtitan_case.py:EMBEDDING_PARTIAL_AS_REPLICATE --world-size 2   # FAILs at forward
"""

from sp_harness import mutant
from sp_harness.cases.frameworks.torchtitan import torchtitan_case, torchtitan_shard
from sp_harness.cases.frameworks.torchtitan.cases import embedding_partial_declared_replicate

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

LLAMA3_SP_TP2 = torchtitan_case("titan-llama3-sp-tp2", SHAPES, tp=2)
LLAMA3_SP_TP4 = torchtitan_case("titan-llama3-sp-tp4", SHAPES, tp=4)
LLAMA3_GQA_SP_TP2 = torchtitan_case("titan-llama3-gqa-sp-tp2", {**SHAPES, "n_kv_heads": 2}, tp=2)
LLAMA3_TP2 = torchtitan_case("titan-llama3-tp2", SHAPES, tp=2, enable_sp=False)  # TP without SP
# another model of torchtitan's registry: qwen3 (GQA, per-head QK norm, tied embeddings)
QWEN3_SP_TP2 = torchtitan_case("titan-qwen3-sp-tp2", {**SHAPES, "n_kv_heads": 2}, tp=2, model="qwen3")
# deepseek_v3: MLA, one dense layer then one MoE layer (4 routed experts, top 2, 1 shared)
DSV3_SP_TP2 = torchtitan_case("titan-dsv3-sp-tp2", {**SHAPES, "num_experts": 4, "top_k": 2, "num_shared_experts": 1},
                              tp=2, model="deepseek_v3")

# the vocab-parallel embedding's Partial output declared Replicate in torchtitan's own plan:
# the per-rank lookups are never summed (pytorch/torchtitan#3468 added the Partial)
EMBEDDING_PARTIAL_AS_REPLICATE = mutant(
    LLAMA3_SP_TP2, name="mutant-titan-embedding-partial-as-replicate-tp2",
    summary="tok_embeddings out_src_shardings TP: R where it is P", bug="vocab-parallel lookups never summed over TP",
    source="pytorch/torchtitan#3468", shard=torchtitan_shard(SHAPES, edit_sharding=embedding_partial_declared_replicate))
