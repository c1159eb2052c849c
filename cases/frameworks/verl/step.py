"""Stage: step. `VerlSFTStep`: one optimizer step of verl's own SFT training step (verl 0.9.1),
in the three parts the training-step check calls (`accumulate`, `grad_norm`, `step`).

verl's SFT path is `verl.trainer.sft_trainer.SFTTrainer.fit` -> `TrainingWorker.train_batch`
(verl/workers/engine_workers.py) -> `FSDPEngine.train_batch` (verl/workers/engine/base.py lines
113-132): `optimizer_zero_grad`, `forward_backward_batch`, `optimizer_step`. The check reads the
grads between the accumulation and the step, so the step calls the engine's own three methods in
that order, split where the check reads, and replays the few lines of `fit` and `train_batch`
around them (cited below). The engine is verl's `FSDPEngineWithLMHead` itself (FSDP2 over the
world, Ulysses over the SP group), built as `TrainingWorker` builds it (`EngineRegistry.new` is
that constructor; the registry keys engines by CUDA / NPU device names, so the class is
constructed directly on CPU). `TrainingWorker` itself is not built: its module imports verl's
rollout servers (uvicorn, fastapi, zmq) and its constructor starts Ray's process-group set-up;
what its `train_batch` adds to the engine's is the default keys, the lr scheduler step and the
reported loss, replayed here line for line.

What runs as verl ships it: the engine's construction (`HFModelConfig`, `_build_module` with
`apply_monkey_patch(ulysses_sp_size=2, use_remove_padding=True)`, FSDP2 `fully_shard` and the
rank-0 state-dict broadcast, the torch optimizer and the constant lr schedule), the micro-batch
split (`prepare_micro_batches`), the padding removal and Ulysses slicing
(`ulysses_pad_and_slice_inputs`), the attention all-to-alls (`_ulysses_flash_attention_forward`),
the log-prob gather (`gather_outputs_and_unpad`), the loss (`sft_loss`: the token-loss sum over
the DP group's token count, times the DP size), FSDP2's deferred grad reduce-scatter
(`set_requires_gradient_sync`), the clipping (`fsdp2_clip_grad_norm_`) and the optimizer step.
The CPU shims are `shims`' (platform, flash-attn kernel, attention name, a trl guard).

Data: each DP replica's K micro-batches of `batch` sequences become one `fit` batch of K x batch
sequences: each sequence without its right padding (verl's NO_PADDING mode: what the SFT
dataset yields and `SFTTensorCollator` nests), `loss_mask` 1 where the target carries loss
(verl's `sft_loss` rolls it by one: token t + 1's loss comes from position t's log-prob, the HF
shift), `micro_batch_size_per_gpu` = batch, so `prepare_micro_batches` cuts back the K
micro-batches, in order. Every SP rank of a replica gets the same batch (verl's sampler is over
the DP rank and size: sft_trainer.py `_build_dataloader`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sp_harness import RankContext, Unsupported
from sp_harness.config.step_protocol import MicroBatch
from sp_harness.step.optim_ref import ADAMW_BETAS, ADAMW_EPS, SGD_MOMENTUM, WEIGHT_DECAY

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
"""The run dtypes verl's engine takes (its PrecisionType: fp16, fp32, bf16; float64 it has not)."""


def sft_loss_function() -> Callable[..., Any]:
    """The SFT trainer's loss: `partial(sft_loss, config=None)` (sft_trainer.py `_build_engine`)."""
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    loss: Any = sft_loss  # its `config` is typed ActorConfig; the SFT trainer passes None
    return partial(loss, config=None)


def rows(micro_batches: Sequence[MicroBatch], ignore_index: int) -> list[dict[str, torch.Tensor]]:
    """What verl's SFT dataset yields in NO_PADDING mode for each sequence of `micro_batches`, in
    order: input_ids and position_ids without the right padding, loss_mask 1 where the target
    carries loss."""
    made = []
    for mb in micro_batches:
        ids, mask = mb.inputs["input_ids"], mb.inputs["attention_mask"]
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            made.append({"input_ids": ids[b, :n], "position_ids": torch.arange(n),
                         "loss_mask": (mb.target[b, :n] != ignore_index).long()})
    return made


@contextlib.contextmanager
def _shared_folder() -> Iterator[str]:
    """A temporary folder rank 0 makes and removes, its path the same on every rank."""
    made: list[Any] = [tempfile.mkdtemp(prefix="verl-model-")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(made, src=0)
    path: str = made[0]
    try:
        yield path
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


class EngineHolder(nn.Module):
    """The engine's FSDP2 model under `lm`, so its params carry the reference's names
    (`lm.model.layers.0...`). The check reads its DTensor params and grads; the step runs it."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("verl's engine runs its model inside VerlSFTStep; the side-by-side check does not "
                                  "call it (this case runs the training-step check alone)")


class VerlSFTStep:
    """One optimizer step of verl's SFT training step on this rank (a `TrainStep`)."""

    def __init__(self, lm: Any, ctx: RankContext, setup: Any):
        from sp_harness.cases.frameworks.verl import shims

        shims.cpu_shims()
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        config = ctx.config
        assert config.optimizer is not None and config.lr is not None, "the check resolves optimizer and lr"
        dtype = config.torch_dtype
        if dtype not in DTYPES:
            raise Unsupported(f"verl's engine takes model_dtype fp16, fp32 or bf16 (its PrecisionType), not {dtype}")
        self.ctx, self.setup = ctx, setup
        self.sp = ctx.tp
        self.ignore_index = setup.ignore_index
        precision = DTYPES[dtype]
        engine_config = FSDPEngineConfig(
            strategy="fsdp2", ulysses_sequence_parallel_size=self.sp, model_dtype=precision,
            # params and compute in the run dtype (autocast off in float32), grads reduced in
            # float32: verl's default reduce_dtype
            mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            # the entropy kernel it would compile is never called by the SFT step
            use_torch_compile=False)
        optim: dict[str, Any]
        if config.optimizer == "sgd":
            optim = dict(optimizer="SGD", weight_decay=0.0, override_optimizer_config={"momentum": SGD_MOMENTUM})
        else:
            optim = dict(optimizer="AdamW", weight_decay=WEIGHT_DECAY, betas=ADAMW_BETAS,
                         override_optimizer_config={"eps": ADAMW_EPS})
        # clip_grad must be set (optimizer_step asserts it): with no clipping asked, an infinite
        # max norm clips by exactly 1 (torch's coefficient clamp)
        optimizer_config = FSDPOptimizerConfig(lr=config.lr, total_training_steps=config.steps or 1,
                                               clip_grad=config.clip_grad_norm or math.inf,
                                               lr_scheduler_type="constant", **optim)
        cls = FSDPEngineWithLMHead if setup.engine_mixin is None else type(
            setup.engine_mixin.__name__, (setup.engine_mixin, FSDPEngineWithLMHead), {})
        # the model verl loads (HFModelConfig(path=...), from_pretrained on rank 0, broadcast by
        # FSDP2): the reference's own weights in the run dtype, as a checkpoint in rank 0's
        # temporary folder (the pool's TMPDIR; transformers' save_pretrained writes on global rank
        # 0 alone), gone once every rank's engine holds them
        with _shared_folder() as path:
            if dist.get_rank() == 0:
                copy.deepcopy(lm).to(dtype).save_pretrained(path)
            dist.barrier()
            model_config = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                                         override_config={"attn_implementation": shims.attention_name()})
            self.engine = cls(model_config=model_config, engine_config=engine_config,
                              optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig())
            self.engine.initialize()
            dist.barrier()
        self._check_groups()
        self.loss_function = setup.loss_function() if setup.loss_function is not None else sft_loss_function()
        self.module = EngineHolder(self.engine.module)
        # a torch optimizer over the model's own (DTensor) params: the check reads its state
        self.optimizer = self.engine.optimizer
        self.mode: Any = None

    def _check_groups(self) -> None:
        """verl's SP group and DP rank, as its device meshes made them, are the harness's."""
        engine, ctx = self.engine, self.ctx
        theirs = tuple(dist.get_process_group_ranks(engine.ulysses_parallel_group)) if self.sp > 1 else (ctx.rank,)
        if theirs != tuple(ctx.tp_ranks) or engine.get_data_parallel_rank() != ctx.dp_rank:
            raise RuntimeError(f"verl's SP group {theirs} / DP rank {engine.get_data_parallel_rank()} are not the "
                               f"harness's {tuple(ctx.tp_ranks)} / {ctx.dp_rank}")

    def _batch(self, micro_batches: Sequence[MicroBatch]) -> Any:
        """`fit`'s batch: the collated sequences as a TensorDict with `fit`'s meta_info
        (sft_trainer.py 0.9.1 lines 350-381), then the keys `TrainingWorker.train_batch` injects
        (engine_workers.py lines 352-362)."""
        from verl.utils import tensordict_utils as tu
        from verl.utils.dataset.dataset_utils import DatasetPadMode, SFTTensorCollator

        config = self.ctx.config
        mine = micro_batches if self.setup.sampler is None else self.setup.sampler(micro_batches, self.ctx)
        batch: Any = SFTTensorCollator(DatasetPadMode.NO_PADDING)(rows(mine, self.ignore_index))
        per_micro = int(mine[0].inputs["input_ids"].shape[0])
        meta_info = {"use_remove_padding": True, "use_dynamic_bsz": False,
                     "max_token_len_per_gpu": int(batch["input_ids"].offsets()[-1]),
                     "micro_batch_size_per_gpu": per_micro, "temperature": 1.0,
                     "global_batch_size": per_micro * len(mine) * config.dp,
                     "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": self.setup.pad_token_id}
        data = tu.get_tensordict(tensor_dict=batch, non_tensor_dict=meta_info)
        seqlens = data["input_ids"].offsets().diff().tolist()
        # tensordict ships no types: its NonTensorData found at run time
        non_tensor = importlib.import_module("tensordict.tensorclass").NonTensorData
        tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=non_tensor(seqlens))
        tu.assign_non_tensor(data, use_fused_kernels=False)
        return data

    def accumulate(self, micro_batches: Sequence[MicroBatch]) -> float:
        from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

        data = self._batch(micro_batches)
        engine = self.engine
        # TrainingWorker.train_batch (engine_workers.py 365-370): the engine's train mode around its
        # train_batch, left at `step` (its exit zeroes the grads)
        self.mode = engine.train_mode(disable_auto_offload=False)
        self.mode.__enter__()
        # BaseEngine.train_batch (base.py 124-127), up to its optimizer_step
        maybe_fix_3d_position_ids(data)
        engine.optimizer_zero_grad()
        outputs = engine.forward_backward_batch(data, self.loss_function, forward_only=False)
        # TrainingWorker._postprocess_output (engine_workers.py 192-198): the micro-batches' losses
        # summed, averaged over the DP group; verl logs it from each SP group's first rank, every
        # rank computes it here (the SP ranks of a correct step hold the same gathered loss)
        loss = torch.sum(torch.tensor(outputs["loss"], device="cpu"))
        dp_group = engine.get_data_parallel_group()
        if dp_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
        return loss.item()

    def grad_norm(self) -> torch.Tensor:
        """`fsdp2_clip_grad_norm_`'s total norm (verl/utils/fsdp_utils.py 629-642) and
        `optimizer_step`'s `.full_tensor()` (transformer_impl.py 821-822), without the clip."""
        from torch.distributed.tensor import DTensor
        from torch.nn.utils.clip_grad import _get_total_norm

        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        norm = _get_total_norm(grads, 2.0, False, None)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> float:
        engine = self.engine
        # BaseEngine.train_batch's last call (base.py 128): clip, skip a non-finite norm, step
        grad_norm = engine.optimizer_step()
        self._leave_train_mode()
        # TrainingWorker.train_batch (engine_workers.py 374-376): fit sets update_lr_scheduler
        engine.lr_scheduler_step()
        return grad_norm

    def _leave_train_mode(self) -> None:
        if self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)

    def zero_grad(self) -> None:
        """An accumulation dropped without stepping (the invariance checks): the engine's train
        mode left as `train_batch` leaves it on an error, zeroing the grads."""
        self.engine.optimizer_zero_grad()
        self._leave_train_mode()


__all__ = ["DTYPES", "EngineHolder", "VerlSFTStep", "rows", "sft_loss_function"]
