"""Training-step mutants of ring attention: its built-in step (cases/train_steps.py) with one
shipped bug each.

Stage: config and step. As with Megatron-style SP's (sp_harness.cases.megatron.train_mutants),
only the training-step check can kill them, at the stage each one's docstring names.
"""

from __future__ import annotations

from sp_harness.cases.ring.cases import RING, ring_shard
from sp_harness.cases.train_steps import StepBugs, every_param, with_train_step
from sp_harness.config.case import Case
from sp_harness.config.registry import mutant


def _ring(name: str, bugs: StepBugs, *, killed_by: tuple[str, ...], **described: str) -> Case:
    shard = with_train_step(ring_shard(), every_param, bugs)
    return mutant(RING, name=name, shard=shard, train_loss=RING.train_loss, tags=("train-step",), killed_by=killed_by,
                  **described)


CP_LOCAL_COUNT = _ring(
    "mutant-train-cp-local-count", StepBugs(local_count="seq"),
    summary="each context-parallel rank normalises by its own valid-token count",
    bug="each CP rank divides its loss by its own valid tokens and the grads are then averaged over CP: with "
        "one valid token a grad is x1/2 at CP 2, x1/4 at CP 4. Caught at the reported loss",
    source="NVIDIA/Megatron-LM issue #7452 finding 9 (PR #7513)",
    killed_by=("reported loss", "train-step"),
)
LOSS_TIMES_SP = _ring(
    "mutant-train-loss-times-sp", StepBugs(loss_times_sp=True),
    summary="the loss and every grad come out multiplied by the sequence-parallel degree",
    bug="each sequence-parallel rank's loss is scaled as if it held the whole sequence: the reported loss and "
        "the grads are x sp_size. Caught at the reported loss",
    source="huggingface/transformers native sequence parallelism through accelerate, #46855 (2026)",
    killed_by=("reported loss", "train-step"),
)
SP_GRADS_UNSYNCED = _ring(
    "mutant-train-sp-grads-unsynced", StepBugs(skip_sp_sync_with_dp=True),
    summary="with DP and SP combined, the grads are never summed over the SP group",
    bug="when data and sequence parallelism combine, only the DP all-reduce runs: every SP rank trains on the "
        "grads of its own slice of the sequence. Caught at the grads before clipping",
    source="ByteDance-Seed/VeOmni #1086",
    killed_by=("grads before clipping", "train-step"),
)
GA_TIMES_SP = _ring(
    "mutant-train-ga-times-sp", StepBugs(ga_times_sp=True),
    summary="the gradient-accumulation divisor is multiplied by the SP degree",
    bug="the accumulation count is multiplied by the sequence-parallel degree, so every grad is / sp_size "
        "while the logged loss looks right. Caught at the grads before clipping",
    source="volcengine/verl Ulysses SFT trainer, #3332",
    killed_by=("grads before clipping", "train-step"),
)
