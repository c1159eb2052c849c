"""Your labels, loss mask, padding and label smoothing through yunchang 0.6.4, checked by sp-harness:

    sp-harness check --case examples/yunchang_token_loss.py:ULYSSES_SFT --world-size 2 --dtype float32   # PASS
    sp-harness check --case examples/yunchang_token_loss.py:USP_SFT --world-size 4 --dtype float64        # PASS

yunchang ships no loss: each rank's loss is its tokens' sum over the sequence's valid tokens, the
labels -100 on the prompt, on a quarter of each sequence and on its 2 trailing pads.
"""

from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.yunchang import ulysses_case, usp_case

SFT = TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2)
ULYSSES_SFT = ulysses_case("my-yc-ulysses-sft", loss=SFT)
USP_SFT = usp_case("my-yc-usp-sft", ring_impl_type="zigzag", loss=SFT)  # ulysses 2 x ring 2 at 4 ranks
