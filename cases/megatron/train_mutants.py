"""Training-step mutants of Megatron-style SP: its built-in step (cases/train_steps.py) with one
shipped bug each.

Stage: config and step. Each changes only the case's own training step, so every side-by-side entry
of the battery (which runs the engine's step) passes it: only the training-step check can kill
it, at the stage its docstring names. The batches that make each visible (uneven valid tokens
across ranks and micro-batches, an empty micro-batch and an empty rank, K = 3) are the check's
own (sp_harness.step.train_batches).
"""

from __future__ import annotations

from sp_harness.cases.megatron.cases import SP, megatron_shard
from sp_harness.cases.megatron.impl import CORRECT
from sp_harness.cases.train_steps import StepBugs, marked_sequence_parallel, with_train_step
from sp_harness.config.case import Case
from sp_harness.config.registry import mutant


def _megatron(name: str, bugs: StepBugs, *, killed_by: tuple[str, ...], **described: str) -> Case:
    shard = with_train_step(megatron_shard(CORRECT, sequence_parallel=True), marked_sequence_parallel, bugs)
    return mutant(SP, name=name, shard=shard, train_loss=SP.train_loss, tags=("train-step",), killed_by=killed_by,
                  **described)


MEAN_OF_MEANS = _megatron(
    "mutant-train-mean-of-means", StepBugs(mean_of_means=True),
    summary="loss = mean of the micro-batch means, not the token mean over the accumulation window",
    bug="each micro-batch's loss normalised by its own valid tokens and the K means averaged: a micro-batch "
        "of few tokens weighs as much as a full one (the reported loss and every grad are off whenever "
        "micro-batches hold different token counts). Caught at the reported loss",
    source="huggingface/transformers gradient accumulation, fixed in PR #34191 (Oct 2024); v4.47.0 doubled the "
           "loss again (#35207)",
    killed_by=("reported loss", "train-step"),
)
DROP_MIDDLE = _megatron(
    "mutant-train-drop-middle-microbatches", StepBugs(drop_middle=True),
    summary="micro-batches 1..K-2 never reach the accumulated grads",
    bug="with gradient accumulation over K >= 3 micro-batches the middle ones' grads are lost: grad = g0 + "
        "g(K-1), while the loss still counts them. Caught at the grads before clipping",
    source="microsoft/DeepSpeed ZeRO-1/2 with CPU optimizer offload and GA >= 3, 0.15.2 to 0.18.x; fixed in "
           "PR #7967 (v0.19.0)",
    killed_by=("grads before clipping", "train-step"),
)
DP_LOCAL_COUNT = _megatron(
    "mutant-train-dp-local-count", StepBugs(local_count="dp"),
    summary="per-token loss normalised by each DP replica's own count, then averaged over DP",
    bug="the per-token loss of each data-parallel replica is divided by that replica's valid tokens and the "
        "replicas averaged: 14/3 instead of 4 in the upstream repro. Caught at the reported loss",
    source="NVIDIA/Megatron-LM issue #7452 finding 3 (MTP loss); huggingface/transformers #34242 (DDP)",
    killed_by=("reported loss", "train-step"),
)
CLIP_MISSING_PARAM = _megatron(
    "mutant-train-clip-missing-param", StepBugs(clip_skips="blocks.1.attn.out_proj.bias"),
    summary="one small param's grad is missing from the global clip norm",
    bug="a parameter (here an attention output bias; upstream the attention sinks under TP) is left out of "
        "the grad norm the clip coefficient comes from: its share of the total is below any honest bound on "
        "the total, so the norm is judged param by param. Caught at the grad norm",
    source="NVIDIA/Megatron-LM issue #7452 finding 8 (PR #7530)",
    killed_by=("grad norm", "train-step"),
)
NORM_AVG_SHARDS = _megatron(
    "mutant-train-norm-avg-shards", StepBugs(norm_avg_shards=True),
    summary="the clip norm averages the TP shards' squares instead of summing them",
    bug="the grad norm over a TP-sharded model all-reduces its squares with an average (or counts replicas "
        "per rank and shards once): the norm, and every clip coefficient, is wrong. Caught at the grad norm",
    source="NVIDIA/Megatron-LM #5916 (expert grad norm 11.51 vs 12.28); microsoft/DeepSpeed #8478 (7.24 vs 10.95)",
    killed_by=("grad norm", "train-step"),
)
LOGGED_LOSS_PER_RANK = _megatron(
    "mutant-train-logged-loss-per-rank", StepBugs(logged_loss_per_rank=True),
    summary="the logged loss is the mean of each rank's own mean, not the token mean",
    bug="the reported loss averages the ranks' per-rank means (a rank with few valid tokens weighs as much as "
        "a full one; about half the true loss at TP2 x CP2); the grads are right. Caught at the reported loss",
    source="pytorch/torchtitan #2206 and #3159",
    killed_by=("reported loss", "train-step"),
)
