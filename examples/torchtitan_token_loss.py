"""Your labels, loss mask, padding and loss function through torchtitan 0.3.0, checked by sp-harness:

    sp-harness check --case examples/torchtitan_token_loss.py:SFT_SP --world-size 2                      # PASS
    sp-harness check --case examples/torchtitan_token_loss.py:SFT_SP --world-size 4 --dp 2 --dtype bfloat16
    sp-harness check --case examples/torchtitan_token_loss.py:SFT_SPMD --world-size 2                    # PASS
    sp-harness check --case examples/torchtitan_token_loss.py:SFT_CP --world-size 2                      # PASS
    sp-harness check --case examples/torchtitan_token_loss.py:OWN_Z_LOSS --world-size 2 --dtype float64  # PASS

The labels are -100 (torchtitan's IGNORE_INDEX) on a quarter of each sequence and on its 2 trailing
pads (causal attention needs no mask for them). Each rank's loss is torchtitan's own
cross_entropy_loss on its vocab-parallel logits (or the CP rank's sequence shard) over the valid
tokens of its replica; the reference computes the same loss on the whole batch in float64.
torchtitan's cross entropy has no label smoothing: a smoothed loss is your own loss_fn.
"""

import torch.nn.functional as F

from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.cases.frameworks.torchtitan import torchtitan_case

SHAPES = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64)
SFT = TokenLoss(masked_fraction=0.25, padding=2)

SFT_SP = torchtitan_case("my-titan-sft-sp", SHAPES, loss=SFT)
SFT_SPMD = torchtitan_case("my-titan-sft-spmd", SHAPES, spmd_backend="spmd_types", loss=SFT)
SFT_CP = torchtitan_case("my-titan-sft-cp", SHAPES, context_parallel=2, loss=SFT)


def z_loss(logits, labels):  # my per-token loss: smoothed cross entropy + 1e-2 logsumexp^2 (PaLM's z-loss)
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none", label_smoothing=0.1)
    return ce.view(labels.shape) + 1e-2 * logits.logsumexp(-1) ** 2


OWN_Z_LOSS = torchtitan_case("my-titan-own-z-loss", SHAPES, loss=TokenLoss(loss_fn=z_loss, masked_fraction=0.25, padding=2))
