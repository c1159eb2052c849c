"""Stage: config and step. DeepSpeed-Ulysses' built-in cases (registered where
DeepSpeed is installed): DeepSpeed 0.19.8's `DistributedAttention` around torch's SDPA in the
reference GPT, its grads reduced by DeepSpeed's engine, and the bugs its users have shipped,
expressed through DeepSpeed's own knobs (`scatter_idx` / `gather_idx`, the `batch_dim_idx` its
forward is told, the `mpu` its engine is given) or the all-to-all's autograd edge; and DeepSpeed's
own engine training step (`ds-ulysses-step*`: ZeRO 0/1/2/3, CPU optimizer offload) for the
training-step check, with two of its ZeRO-Offload bugs put back into its optimizer and a user's
loss divided by the accumulation steps twice."""

from sp_harness.cases.frameworks.deepspeed.case import detached, sdpa_attention, ulysses_case, ulysses_shard
from sp_harness.cases.frameworks.deepspeed.hf import hf_ulysses_case
from sp_harness.cases.frameworks.deepspeed.step import DeepSpeedStepConfig, ds_step_case, ds_step_shard
from sp_harness.cases.frameworks.releases import ShippedBug, release_case, shown_with
from sp_harness.cases.frameworks.token_loss import TokenLoss
from sp_harness.config.case import Example
from sp_harness.config.registry import mutant, register

ISOLATION = "deepspeed"
"""DeepSpeed's comm backend, its sequence-parallel groups and its `groups.mpu` are process-wide:
its cases share processes only with each other."""

DS_ULYSSES = register(ulysses_case(
    "ds-ulysses", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="SP 2: 12 tokens 6/6, 4 heads 2/2, DeepSpeed's engine"),
              Example(fields=(("world_size", 3),),
                      note="SP 3: 4 heads 2/1/1 through DeepSpeed's uneven-heads all-to-all"),
              Example(fields=(("world_size", 4), ("dp", 2), ("dtype", "bfloat16")),
                      note="DP 2 x SP 2 in bfloat16, the engine's sum over SP and mean over DP"),
              Example(fields=(("world_size", 2), ("layout", "sbh"), ("num_kv_heads", 2)),
                      note="DeepSpeed's seq-first layout (batch_dim_idx 1, gather_idx 0), grouped-query k/v"))))

DS_ULYSSES_F64 = register(ulysses_case(
    "ds-ulysses-f64", grad_sync="all-reduce", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="float64: DeepSpeed's all-to-alls at full precision"),)))
"""float64, which DeepSpeed's engine refuses to reduce: its grad sum written out."""

mutant(DS_ULYSSES, name="mutant-ds-ulysses-detached-a2a",
       summary="q/k/v reach the local attention detached from DeepSpeed's all-to-all",
       bug="DeepSpeed's all-to-all sends no grad back: the q/k/v projections never learn (forward exact)",
       source="deepspeedai/DeepSpeed#8491",
       shard=ulysses_shard(local_attention=detached(sdpa_attention)), killed_by=("grad", "even"))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-batch-dim-idx",
       summary="[b, s, h, d] tensors handed to DistributedAttention with batch_dim_idx=1 (seq-first)",
       bug="the all-to-all told the wrong batch dim: batch taken for sequence, attention over the wrong tokens",
       source="deepspeedai/DeepSpeed#5808",
       shard=ulysses_shard(local_attention=sdpa_attention, batch_dim_idx=1), killed_by=("forward", "even"))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-scatter-gather-swapped",
       summary="DistributedAttention(scatter_idx=1, gather_idx=2): the head and sequence dims swapped",
       bug="the first all-to-all scatters the sequence and gathers heads instead of the reverse",
       source="deepspeedai/DeepSpeed#4359",
       shard=ulysses_shard(local_attention=sdpa_attention, scatter_idx=1, gather_idx=2), killed_by=("forward", "even"))

DS_ULYSSES_UNEVEN_HEADS = register(ulysses_case(
    "ds-ulysses-uneven-heads", grad_sync="all-reduce", isolation=ISOLATION, defaults=dict(num_heads=3, hidden=24),
    examples=(Example(fields=(("world_size", 2),), note="3 heads over SP 2 (2/1): DeepSpeed's uneven-heads all-to-all"),)))
"""float64, 3 heads: every SP degree but 3 takes DeepSpeed's uneven-heads all-to-all (the engine's sums written out)."""

DS_ULYSSES_ZERO2 = register(ulysses_case(
    "ds-ulysses-zero2", ds_config={"zero_optimization": {"stage": 2}}, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2)),
                      note="ZeRO-2's grad hooks and partitions over DP 2 x SP 2, grads read back whole"),)))
"""The engine at ZeRO stage 2: its reduce over the sequence-data-parallel group, read by safe_get_full_grad."""

mutant(DS_ULYSSES_UNEVEN_HEADS, name="mutant-ds-ulysses-uneven-heads-without-mpu",
       summary="DistributedAttention on the SP group with no DeepSpeed mpu installed: uneven heads read SP rank 0",
       bug="uneven_heads_all2all takes its rank from deepspeed.utils.groups' mpu, not the group it is handed: without "
           "an mpu every rank reads rank 0's head count, so the all-to-all's splits disagree (gloo aborts; wrong "
           "heads where sizes happen to match)",
       source="deepspeedai/DeepSpeed#6392 (uneven-heads all-to-all: local_heads = splits[groups._get_sequence_parallel_rank()])",
       shard=ulysses_shard(local_attention=sdpa_attention, grad_sync="all-reduce", mpu=False),
       killed_by=("crash", "even"))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-engine-without-sp-group",
       summary="deepspeed.initialize without the sequence-parallel mpu",
       bug="grads averaged over every rank instead of summed over SP and averaged over DP (1/sp too small)",
       source="deepspeedai/DeepSpeed#5555",
       shard=ulysses_shard(local_attention=sdpa_attention, mpu=False), killed_by=("grad", "even"))

mutant(DS_ULYSSES, name="mutant-ds-ulysses-stale-kv-heads",
       summary="DistributedAttention splitting a 4-head model against a head count of 3 left by another model",
       bug="before #8316 the uneven-heads all-to-all split against a process-wide head count that the first model "
           "to take that path set: a second model with other heads is split against the first one's. Here 4 heads "
           "over SP 2 against 3: the scatter sends 2 heads to each rank, the gather expects 2 and 1 (gloo aborts "
           "on the mismatched sizes; #8291 reports the all-to-all silently corrupted)",
       source="deepspeedai/DeepSpeed#8291 (process-wide _ulysses_num_kv_heads; fixed by #8316, the count carried "
              "per DistributedAttention, which is how the stale count is handed in here)",
       shard=ulysses_shard(local_attention=sdpa_attention, num_kv_heads=3), killed_by=("crash", "even"))

USER_LOSS = TokenLoss(label_smoothing=0.1, masked_fraction=0.25, padding=2)
"""A fine-tuning batch: a quarter of each sequence's labels masked, 2 trailing pads, smoothing 0.1."""

DS_ULYSSES_TOKEN_LOSS = register(ulysses_case(
    "ds-ulysses-token-loss", loss=USER_LOSS, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),),
                      note="your labels (-100 masked, padded) and label smoothing, the token mean over the sequence"),)))
"""The user's `TokenLoss` through DistributedAttention and the engine: each SP rank's loss sum over
the sequence's valid tokens (counted over the SP group)."""

mutant(DS_ULYSSES_TOKEN_LOSS, name="mutant-ds-ulysses-loss-per-shard-mean",
       summary="each SP rank's loss is the token mean of its own shard",
       bug="every SP rank divides its token-loss sum by its own shard's valid tokens instead of the sequence's: the "
           "shards' means are summed: the loss is about sp x the token mean and the shards' tokens are weighted "
           "unequally where their valid counts differ (masked labels, padding in the last shard)",
       source="huggingface/transformers#41832 (the ALST/Ulysses Trainer integration weights each shard's loss by its "
              "good tokens over the sequence's: 'special dealing with SFT that has prompt tokens that aren't used "
              "in loss computation')",
       shard=ulysses_shard(local_attention=sdpa_attention, loss=USER_LOSS, normalise="shard"),
       killed_by=("forward (loss)", "even"))


def detached_exchange(group, tensor):
    """DeepSpeed's `_dim_zero_all_to_all` whose output carries no dependence on its input: what
    a compiled graph held before deepspeedai/DeepSpeed#8491 (Dynamo inlined the autograd
    function, whose collective filled an `empty_like` buffer, so the traced derivative was zero
    and the hand-written backward never ran). The forward is exact."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all

    return _dim_zero_all_to_all(group, tensor.detach())


# these four run only where transformers is installed too (ALSO_NEEDED in sp_harness.cases.frameworks);
# registering them imports none of it
DS_ULYSSES_HF = register(hf_ulysses_case(
    "ds-ulysses-hf-llama", isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="UlyssesSPAttentionHF (sdpa) on a tiny HF Llama, SP 2"),
              Example(fields=(("world_size", 4), ("dtype", "bfloat16")), note="SP 4: one head per rank, bfloat16"))))
"""DeepSpeed's Arctic (ALST) Ulysses for HF transformers: registered over transformers' sdpa."""

DS_ULYSSES_HF_QWEN2 = register(hf_ulysses_case(
    "ds-ulysses-hf-qwen2", dict(num_key_value_heads=2), model_type="qwen2", grad_sync="all-reduce",
    isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 2),), note="UlyssesSPAttentionHF on a tiny HF Qwen2 (GQA 4/2), float64"),)))
"""An HF Qwen2 in float64 (q/k/v biases, GQA), the engine's sums written out."""

mutant(DS_ULYSSES_HF, name="mutant-ds-ulysses-hf-local-position-ids",
       summary="each rank hands the HF model position_ids 0..S/sp-1 of its own shard",
       bug="RoPE rotates every shard as if it began the sequence, and UlyssesSPAttentionHF all-gathers the local "
           "ids into what looks like sp packed documents: wrong attention from rank 1's tokens on",
       source="huggingface/trl#6812 (Ulysses batches without global position_ids); deepspeedai/DeepSpeed "
              "ulysses_sp.py's position_ids assert names the failure",
       shard=hf_ulysses_case("local-position-ids", position_ids="local").shard, killed_by=("forward", "even"))

mutant(DS_ULYSSES_HF, name="mutant-ds-ulysses-hf-exchange-detached",
       summary="UlyssesSPAttentionHF's sequence <-> heads exchange returns a tensor detached from its input",
       bug="no grad reaches the attention's q/k/v projections (or anything before them through attention) while "
           "the forward, the loss, o_proj and the MLPs are right: a torch.compile'd Ulysses job whose attention "
           "stops learning",
       source="deepspeedai/DeepSpeed#8491 (_DimZeroAllToAll silently fails to send grads under torch.compile)",
       shard=hf_ulysses_case("exchange-detached", exchange=detached_exchange).shard, killed_by=("grad", "even"))


# --- DeepSpeed's engine training step (the training-step check: sp-harness check --train-step) ---

ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
_STEP = (("train_step", True), ("micro_batches", 3), ("optimizer", "sgd"), ("clip_grad_norm", 0.01))

DS_STEP = register(ds_step_case(
    "ds-ulysses-step", {"zero_optimization": {"stage": 0}}, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP),
                      note="engine.backward / engine.step over K=3, stage 0, SGD with clipping active"),)))
"""DeepSpeed's engine step at stage 0: the client optimizer stepped unwrapped (float32)."""

DS_STEP_ZERO1 = register(ds_step_case(
    "ds-ulysses-step-zero1", {"zero_optimization": {"stage": 1}}, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP), note="ZeRO-1: optimizer states partitioned"),)))

DS_STEP_ZERO2 = register(ds_step_case(
    "ds-ulysses-step-zero2", ZERO2, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP), note="ZeRO-2: grads reduce-scattered"),)))

DS_STEP_OFFLOAD = register(ds_step_case(
    "ds-ulysses-step-offload", ZERO2_OFFLOAD, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP),
                      note="ZeRO-2 with offload_optimizer cpu (the client optimizer on the CPU partitions)"),)))

DS_STEP_OFFLOAD_MULTI = register(ds_step_case(
    "ds-ulysses-step-offload-multi-backward", ZERO2_OFFLOAD, step=DeepSpeedStepConfig(boundary="user"),
    isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP),
                      note="gradient_accumulation_steps 1, K backwards per step via set_gradient_accumulation_boundary"),)))

DS_STEP_ZERO3 = register(ds_step_case(
    "ds-ulysses-step-zero3", {"zero_optimization": {"stage": 3, "reduce_scatter": False}}, isolation=ISOLATION,
    examples=(Example(fields=(("world_size", 4), ("dp", 2), *_STEP),
                      note="ZeRO-3 through its all-reduce path (its default reduce_scatter path is UNSUPPORTED: "
                           "it averages grads over SP too)"),)))
"""ZeRO-3 on the tiny GPT: every param below stage3_param_persistence_threshold stays whole."""

DS_STEP_DROPS_MIDDLE = mutant(DS_STEP_OFFLOAD, name="mutant-ds-step-offload-drops-middle",
       summary="ZeRO-2 CPU offload with GA >= 3: DeepSpeed's CPU grad buffer written at micro-step 0 only",
       bug="async_accumulate_grad_in_cpu_via_gpu before the fix: micro-batches 1..K-2 are added to the device grad "
           "but never saved to the CPU accumulator, so the boundary sees g0 + g(K-1) (DeepSpeed 0.15.2 to 0.18.x). "
           "Caught at the grads before clipping",
       source="deepspeedai/DeepSpeed#7967 (bug from #6550, fixed in 0.19.0)",
       shard=ds_step_shard(ZERO2_OFFLOAD, DeepSpeedStepConfig(regress=("7967",))), train_loss=DS_STEP_OFFLOAD.train_loss,
       tags=("train-step",), killed_by=("grads before clipping", "train-step"))

DS_STEP_KEEPS_LAST = mutant(DS_STEP_OFFLOAD_MULTI, name="mutant-ds-step-offload-multi-backward-keeps-last",
       summary="ZeRO-2 CPU offload, several backwards per step at GA 1: only the last backward's grads kept",
       bug="copy_grads_in_partition before the fix gated the CPU accumulation on gradient_accumulation_steps > 1, "
           "so with GA 1 and set_gradient_accumulation_boundary the boundary overwrote the fp32 grads with the last "
           "backward's. Caught at the grads before clipping",
       source="deepspeedai/DeepSpeed#7981",
       shard=ds_step_shard(ZERO2_OFFLOAD, DeepSpeedStepConfig(boundary="user", regress=("7981",))),
       train_loss=DS_STEP_OFFLOAD_MULTI.train_loss, tags=("train-step",),
                                                    killed_by=("grads before clipping", "train-step"))

DS_STEP_GAS_TWICE = mutant(DS_STEP_ZERO2, name="mutant-ds-step-loss-scaled-by-gas-twice",
       summary="a loss already normalised over the accumulation window handed to engine.backward unchanged",
       bug="engine.backward divides the loss by gradient_accumulation_steps again (scale_wrt_gas defaults to True): "
           "grads and the grad norm are 1/K of the token mean's while the logged loss is right. Caught at the grads "
           "before clipping (a uniform factor 1/K)",
       source="huggingface/transformers#35808 (Trainer + DeepSpeed: grad_norm depends on gradient_accumulation_steps); "
              "deepspeedai/DeepSpeed#7439",
       shard=ds_step_shard(ZERO2, DeepSpeedStepConfig(undo_gas_scaling=False)), train_loss=DS_STEP_ZERO2.train_loss,
       tags=("train-step",), killed_by=("grads before clipping", "train-step"))


# --- release cases: DeepSpeed's own shipped bugs, on the releases that shipped them (sp-harness releases) ---

_ONE_STEP = (("world_size", 2), ("dtype", "float32"), ("train_step", True), ("micro_batches", 3),
             ("optimizer", "sgd"), ("clip_grad_norm", 0.01), ("steps", 1))
"""SP 2, K 3, one step with clipping active: each engine-step bug shows in the first step's grads."""

BUG_7967 = ShippedBug(
    distribution="deepspeed", first="0.16.0", fixed="0.19.0", stage="grads before clipping",
    summary="ZeRO-2 + CPU optimizer offload, gradient accumulation K >= 3: micro-batches 1..K-2 never reach the CPU "
            "accumulator (async_accumulate_grad_in_cpu_via_gpu copies to the CPU at micro-step 0 only; shipped "
            "from 0.15.2, #6550)",
    source="deepspeedai/DeepSpeed#7967 (fixed in 0.19.0)")
RELEASE_7967 = release_case(DS_STEP_OFFLOAD, name="release-ds-7967-offload-ga3-drops-middle", bug=BUG_7967,
                            fields=_ONE_STEP, note="the correct user loop, ZeRO-2 offload, K 3")

BUG_7981 = ShippedBug(
    distribution="deepspeed", first="0.16.0", fixed="0.19.0", stage="grads before clipping",
    summary="ZeRO-1/2 + CPU optimizer offload, several backwards per step at gradient_accumulation_steps 1 "
            "(set_gradient_accumulation_boundary): only the last backward's grads reach the fp32 partition "
            "(copy_grads_in_partition accumulated on the CPU only with gradient_accumulation_steps > 1)",
    source="deepspeedai/DeepSpeed#7981 (fixed in 0.19.0)")
RELEASE_7981 = release_case(DS_STEP_OFFLOAD_MULTI, name="release-ds-7981-offload-multi-backward-keeps-last",
                            bug=BUG_7981, fields=_ONE_STEP, note="GA 1, K 3 backwards and one engine.step, ZeRO-2 offload")

BUG_8317 = ShippedBug(
    distribution="deepspeed", first="0.16.3", fixed="0.19.7", stage="crash",
    summary="DistributedAttention in the seq-first layout (batch_dim_idx 1): the output all-to-all reshapes to "
            "[b, sp*s, heads/sp, d] instead of [s/sp, b, sp*heads, d]: a mis-strided attention output (silent in a "
            "forward alone) whose grad autograd refuses in the backward ('returned an invalid gradient'), or a "
            "reshape error where the local heads do not divide sp; from #6750's refactor",
    source="deepspeedai/DeepSpeed#8317 (fixed in 0.19.7)")
RELEASE_8317 = release_case(DS_ULYSSES, name="release-ds-8317-seq-first-output-layout", bug=BUG_8317,
                            fields=(("world_size", 2), ("layout", "sbh"), ("num_heads", 8)),
                            note="[s, b, h, d] tensors (Megatron-DeepSpeed's layout), 8 heads over SP 2: the "
                                 "forward's reshape succeeds, the backward hands autograd a [b, sp*s, ...] grad")

BUG_6774 = ShippedBug(
    distribution="deepspeed", first="0.16.0", fixed="0.16.2", stage="crash",
    summary="DistributedAttention's output all-to-all takes the uneven-heads path whenever its local head count "
            "does not divide sp (4 heads over SP 4: 1 local head), and asserts 'Number of heads (1) must be larger "
            "than sequence parallel size (4)' on an even split",
    source="deepspeedai/DeepSpeed#6774 (fixed by #6797 in 0.16.2)")
RELEASE_6774 = release_case(DS_ULYSSES, name="release-ds-6774-output-a2a-uneven-path", bug=BUG_6774,
                            fields=(("world_size", 4),), note="4 heads over SP 4, one head per rank")

BUG_7649 = ShippedBug(
    distribution="deepspeed", first="0.17.0", fixed="0.18.2", stage="crash",
    summary="ZeRO stage 0 with DeepSpeed's own Ulysses mpu (parallel_state_sp), which lacks get_model_parallel_*: "
            "in float32 with gradient_clipping engine.step's clip_fp32_gradients calls clip_grad_norm_(mpu=...), "
            "which asks it for get_model_parallel_rank; in bfloat16 (0.17.6 on) FP16_UnfusedOptimizer's overflow "
            "check all-reduces over its get_model_parallel_group: AttributeError at the first step",
    source="deepspeedai/DeepSpeed#7649 (the slim mpu's get_model_parallel_* API, added for save_checkpoint; 0.18.2)")
RELEASE_7649 = release_case(DS_STEP, name="release-ds-7649-stage0-clip-slim-mpu", bug=BUG_7649, fields=_ONE_STEP,
                            note="stage 0, float32, clipping active: DeepSpeed clips with its own clip_grad_norm_")

BUG_7509 = ShippedBug(
    distribution="deepspeed", first="0.17.6", fixed="0.18.3", stage="grads before clipping",
    summary="ZeRO-2 without offload, gradient accumulation K >= 2: the epilogue decides whether to start or add to "
            "its accumulator by `averaged_gradients` (set only at the boundary) instead of `all_grad_tensors`, so "
            "the micro-batches are not accumulated (measured on CPU: every grad and the grad norm 0 at the "
            "boundary); from #7509 (Muon)",
    source="deepspeedai/DeepSpeed#7665 (the condition fixed in 0.18.3; introduced by #7509 in 0.17.6)")
RELEASE_7509 = release_case(DS_STEP_ZERO2, name="release-ds-7509-zero2-ga-accumulator", bug=BUG_7509,
                            fields=_ONE_STEP, note="ZeRO-2, no offload, K 3: the plainest accumulation there is")

_BF16_STAGE0 = (("world_size", 2), ("dtype", "bfloat16"), ("train_step", True), ("micro_batches", 3))
"""SP 2, K 3, no clipping: the stage-0 bfloat16 cases' config, their optimizer and steps added."""

BUG_7837 = ShippedBug(
    distribution="deepspeed", first="0.17.6", fixed="0.18.6", stage="update given the grads",
    summary="ZeRO stage 0 in bfloat16 (#7515's native bf16 DDP: FP16_UnfusedOptimizer): the wrapper keeps fp16's "
            "dynamic loss scale (65536) although engine.backward never scales a bf16 loss, so its step divides the "
            "grads it applies by it, and _take_model_step skips zero_grad, so grads accumulate across steps "
            "(measured on 0.18.5: SGD's first update 174x its bound off the one its grads give)",
    source="deepspeedai/DeepSpeed#7837 (fixed by #7839 in 0.18.6)")
SHOWN_7837 = shown_with(BUG_7837, BUG_7649)
"""#7837 as its config (bfloat16 stage 0) shows it: a crash through #7649's missing API before 0.18.2
(measured on 0.17.6)."""
RELEASE_7837 = release_case(DS_STEP, name="release-ds-7837-stage0-bf16-loss-scale", bug=SHOWN_7837,
                            fields=(*_BF16_STAGE0, ("optimizer", "sgd"), ("steps", 2)),
                            note="stage 0, bfloat16, SGD (which the init step below leaves exact), two steps")

BUG_INIT_STEP = ShippedBug(
    distribution="deepspeed", first="0.17.6", fixed=None, stage="update given the grads",
    summary="ZeRO stage 0 in bfloat16 wraps the client optimizer in FP16_UnfusedOptimizer, whose constructor "
            "steps it once with zero grads (initialize_optimizer_states): torch's AdamW counts that step, so "
            "every real step t takes step t+1's bias correction (the first update 0.744x AdamW's, measured: the "
            "state's step reads 2 after the first engine.step) and one extra weight decay; SGD is unaffected. "
            "Before 0.17.6 bf16 stage 0 took BF16_Optimizer, which does not step",
    source="deepspeedai/DeepSpeed#5104 (the same init step, removed from ZeRO 1-3; FP16_UnfusedOptimizer still has "
           "it in 0.19.8, the newest release)")
SHOWN_INIT_STEP = shown_with(BUG_INIT_STEP, BUG_7837, BUG_7649)
"""The init step as its config (bfloat16 stage 0) shows it: with #7837 too on 0.17.6 to 0.18.5, a
crash through #7649's missing API before 0.18.2."""
RELEASE_INIT_STEP = release_case(DS_STEP, name="release-ds-stage0-bf16-adamw-init-step", bug=SHOWN_INIT_STEP,
                                 fields=(*_BF16_STAGE0, ("optimizer", "adamw"), ("steps", 1)),
                                 note="stage 0, bfloat16, the client torch AdamW, one step")
