"""Stage: config and step. verl's built-in cases (registered where verl is installed): its own SFT
training step with Ulysses SP on a tiny Llama, and the sequence-parallel bugs other frameworks
shipped, reintroduced through verl's own extension points (the loss function the trainer hands
the engine, an engine subclass, the dataloader) as a user or a fork would write them. Each
mutant's expected verdict is FAIL at its named stage (`killed_by`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from sp_harness.cases.frameworks.verl.case import ISOLATION, VerlSFTSetup, verl_sft_case, verl_sft_shard
from sp_harness.config.case import Example
from sp_harness.config.rank_context import RankContext
from sp_harness.config.registry import mutant, register
from sp_harness.config.step_protocol import MicroBatch


class GradSyncWithoutSP:
    """An engine whose FSDP2 mesh is the DP axis alone: the grad reduce-scatter runs over the DP
    ranks and never over the SP ranks of a replica, so each rank keeps the grad of its own
    sequence shard (VeOmni's DDP wrapped over `dp_group`, which Ulysses leaves out of). Without SP
    (one rank: the degree-invariance check's twin) verl builds no Ulysses mesh and there is no SP
    rank to leave out: the engine's own."""

    def _build_fsdp_module(self, module):
        if self.ulysses_device_mesh is None:
            return super()._build_fsdp_module(module)
        whole = self.device_mesh
        self.device_mesh = self.ulysses_device_mesh["dp"]
        try:
            return super()._build_fsdp_module(module)
        finally:
            self.device_mesh = whole


def _dp_size_as_world():
    """`sft_loss` handed the world size where it reads the DP size (`data["dp_size"]`): the loss
    and grads come out x SP."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss

    def loss(model_output, data, dp_group=None):
        tu.assign_non_tensor(data, dp_size=dist.get_world_size())
        return sft_loss(None, model_output, data, dp_group)

    return loss


def _shuffled_per_sp_rank(micro_batches: Sequence[MicroBatch], ctx: RankContext) -> Sequence[MicroBatch]:
    """Each SP rank but the first hands the trainer its micro-batches' sequences in another order
    (a collate that shuffles with a rank-seeded generator): the SP group's ranks pack different
    sequences, which the all-to-alls then mix."""
    if ctx.tp_rank == 0:
        return micro_batches
    return [replace(mb, inputs={k: v.flip(0) for k, v in mb.inputs.items()}, target=mb.target.flip(0),
                    valid=mb.valid.flip(0)) for mb in micro_batches]


def _examples(*more):
    return (Example(fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 2),
                            ("optimizer", "adamw"), ("dtype", "float32")),
                    note="DP 2 x SP 2, K=2, verl's AdamW, float32"),
            Example(fields=(("world_size", 4), ("dp", 2), ("train_step", True), ("micro_batches", 2),
                            ("optimizer", "adamw"), ("dtype", "bfloat16")),
                    note="DP 2 x SP 2, K=2, verl's AdamW, bfloat16"), *more)


VERL_SFT_SP = register(verl_sft_case("verl-sft-sp-llama", isolation=ISOLATION, examples=_examples()))
"""verl 0.9.1's SFT step with ulysses_sequence_parallel_size = world size / dp."""

mutant(VERL_SFT_SP, name="mutant-verl-sp-grads-not-synced-over-sp",
       summary="the engine's grad sync group is the DP axis alone (the SP ranks left out)",
       bug="the grad reduce-scatter runs over the DP group, which Ulysses shrinks to world / sp and which excludes "
           "the SP ranks of a replica: each rank steps on the grad of its own 1/sp of the sequence, silently",
       source="ByteDance-Seed/VeOmni#1059 (DDP wrapped with process_group=dp_group under Ulysses SP; fixed by "
              "PR #1086 syncing over the dp x sp group)",
       shard=verl_sft_shard(VerlSFTSetup(engine_mixin=GradSyncWithoutSP)), train_loss=VERL_SFT_SP.train_loss,
       tags=("train-step",), killed_by=("grads before clipping", "train-step"))

mutant(VERL_SFT_SP, name="mutant-verl-sp-dp-size-as-world-size",
       summary="sft_loss scaled by the world size where it means the DP size",
       bug="the loss's DP factor (it undoes FSDP's average over the ranks) taken as the world size, which SP makes "
           "sp x the DP size: the reported loss and every grad are sp x the token mean's",
       source="modelscope/twinkle#30 (data_world_size used the world size under Ulysses); verl's own sft_loss "
              "reads data['dp_size'] = world size // ulysses size (verl/workers/engine/fsdp/transformer_impl.py "
              "get_data_parallel_size)",
       shard=verl_sft_shard(VerlSFTSetup(loss_function=_dp_size_as_world)), train_loss=VERL_SFT_SP.train_loss,
       tags=("train-step",), killed_by=("reported loss", "train-step"))

mutant(VERL_SFT_SP, name="mutant-verl-sp-ranks-see-different-sequences",
       summary="the SP ranks of one replica are handed its sequences in different orders",
       bug="Ulysses needs every SP rank of a group to pack the same sequences; a per-rank shuffle (worker RNG seeded "
           "by the global rank) gives each its own packing, and the all-to-alls join shards of different sequences",
       source="axolotl-ai-cloud/axolotl#3920 (dataloader workers seeded by global rank under SP: different batches "
              "per SP rank, silently corrupting training); verl seeds and samples by the DP rank "
              "(verl/trainer/sft_trainer.py _build_dataloader)",
       shard=verl_sft_shard(VerlSFTSetup(sampler=_shuffled_per_sp_rank)), train_loss=VERL_SFT_SP.train_loss,
       tags=("train-step",), killed_by=("reported loss", "train-step"))

__all__ = ["GradSyncWithoutSP", "VERL_SFT_SP"]
