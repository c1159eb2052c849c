"""torchtitan 0.3.0's llama3 with its FlexAttention and packed-document masks (its flavors' default
attention), TP 2 + SP, checked by sp-harness forward-only (torch's CPU flex kernel has no backward):

    sp-harness check --case examples/torchtitan_flex.py:FLEX_DOCS --world-size 2 --dtype float32 --forward-only yes
    sp-harness check --case examples/torchtitan_flex.py:FLEX_DOCS --world-size 2 --dtype bfloat16 --forward-only yes

Each row packs 3 documents (positions restart at 0); torchtitan's get_attention_masks builds its
causal + document BlockMask before each forward. The reference is a dense SDPA under a mask built
from the same positions. The first run compiles the flex kernel (about 40 s on 2 cores, cached
in ~/.cache/sp-harness/torchinductor for the next).
"""

from sp_harness.cases.frameworks.torchtitan import torchtitan_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)

FLEX_DOCS = torchtitan_case("my-titan-flex-docs", SHAPES, attn_backend="flex", documents=3)

# --- a mutant, for the check's sake: the masks built as if every row were one document (causal
# only), so tokens attend across document boundaries
from sp_harness import mutant  # noqa: E402
from sp_harness.cases.frameworks.torchtitan import torchtitan_shard  # noqa: E402

DOCUMENTS_IGNORED = mutant(
    FLEX_DOCS, name="mutant-titan-flex-documents-ignored", summary="causal mask only: documents attend across",
    bug="the packed-document mask built without the documents' boundaries: cross-document attention",
    source="vllm-project/speculators#621 (fixed by #629); huggingface/transformers#37429",
    shard=torchtitan_shard(SHAPES, attn_backend="flex", see_documents=False))
