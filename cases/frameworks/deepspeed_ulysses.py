"""Stage: step. DeepSpeed-Ulysses as a system under test: DeepSpeed's own
`deepspeed.sequence.layer.DistributedAttention` wrapped around a user's local attention inside a
small GPT, sequence-sharded over the rank's SP group, its grads reduced by DeepSpeed's engine.

    from sp_harness.cases.frameworks.deepspeed_ulysses import sdpa_attention, ulysses_case
    DS_ULYSSES = ulysses_case("my-ds-ulysses", local_attention=sdpa_attention)

- The reference is the project's GPT (reference/gpt.py: embeddings, pre-norm blocks, MLP, LM
  head) whose attention calls the user's local attention on every head and the whole sequence:
  what `DistributedAttention` computes at SP=1, without DeepSpeed. Built float64.
- The sharded twin reuses the reference's modules (same parameter names, replicated weights);
  every activation outside attention holds this rank's `seq_len / sp` tokens. In each block the
  q/k/v projections of its tokens go through DeepSpeed's `DistributedAttention(local_attention,
  ctx.tp_group, scatter_idx, gather_idx)`: DeepSpeed's all-to-all sequence->heads, the user's
  attention on this rank's heads over the whole sequence, DeepSpeed's all-to-all back. Layout
  'bsh' hands DeepSpeed [b, s, h, d] (batch_dim_idx 0, gather_idx 1); layout 'sbh' [s, b, h, d]
  (batch_dim_idx 1, gather_idx 0: Megatron-DeepSpeed's layout and DeepSpeed's defaults).
- Grad sync is DeepSpeed's engine (`grad_sync="engine"`): `deepspeed.initialize(model, config
  (ZeRO stage 0), mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp)` after DeepSpeed's
  own `initialize_sequence_parallel(sp)`; after backward, `engine.allreduce_gradients()` sums the
  grads over the SP group and averages them over DP (its `_reduce_non_expert_gradients`: the
  sequence-data-parallel group, divided by its size / sp). DeepSpeed's engine reduces only its
  accelerator's `supported_dtypes()` (float32, bfloat16, float16 where supported): at float64 it
  raises "attempting to reduce an unsupported grad type", so float64 runs are UNSUPPORTED with
  the engine and checked with `grad_sync="all-reduce"` (the same SUM over SP / mean over DP,
  written out, with DeepSpeed's mpu installed as the engine installs it).
- Per-process setup (`Case.setup`): DeepSpeed's import and the JIT build of its CPU
  `deepspeed_shm_comm` op, which `deepspeed.init_distributed` loads (minutes on a loaded 2-core
  machine the first time; cached in ~/.cache/torch_extensions afterwards). A build killed mid-way
  leaves torch's build lock behind; the next setup removes it, with a warning
  (`build_extension_exclusively`).
- Launcher environment (`launcher_env`): DeepSpeed's engine asserts `LOCAL_RANK` is set (its
  launcher, torchrun or init_distributed's MPI discovery set it); the harness starts its ranks
  itself, so it is set to the rank's device index (CPU: the rank; one host). No CPU shim is
  needed: DeepSpeed's accelerator detection picks its CPU accelerator and the gloo backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sp_harness import Batch, Case, Layout, RankContext, Sharded, Unsupported
from sp_harness.cases.common import (
    GPT_DEFAULTS,
    as_gpt,
    attention_of,
    gpt_batch,
    gpt_config,
    gpt_tokens,
    known,
    with_positions,
)
from sp_harness.cases.frameworks.common import build_extension_exclusively
from sp_harness.reference.gpt import GPT, Attention, build_gpt, token_loss_sum

DEEPSPEED_VERSION = "0.19.8"
"""The release this module is tested with (the `deepspeed` extra pins it)."""

SHM_OP_NAME = "deepspeed_shm_comm"
"""The torch extension `build_shm_op` JIT-builds (DeepSpeed's `ShareMemCommBuilder.NAME`: its
build dir and torch's build lock are named after it)."""

LocalAttentionFn = Callable[..., torch.Tensor]
"""`fn(q, k, v, *, causal) -> out`: q (B, S, a, d), k and v (B, S, a_kv, d) with a_kv dividing
a (grouped-query), out (B, S, a, d). DeepSpeed's batch-first layout; under layout 'sbh' the
adapter hands it the same tensors transposed to batch-first."""


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """torch's scaled_dot_product_attention as a local attention: (B, S, a, d) -> (B, S, a, d)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def detached(fn: LocalAttentionFn) -> LocalAttentionFn:
    """`fn` on q, k, v detached from the graph: what DeepSpeed's all-to-all delivered under
    torch.compile before deepspeedai/DeepSpeed#8491 (the exchange's output carried no dependence
    on its input, so no grad reached the q/k/v projections; the forward is unchanged)."""

    def local(q, k, v, *, causal):
        return fn(q.detach(), k.detach(), v.detach(), causal=causal)

    return local


class LocalAttention(nn.Module):
    """What DistributedAttention wraps: the user's function in DeepSpeed's layout of the run
    ([b, s, h, d] for batch_dim_idx 0, [s, b, h, d] for 1; the function always sees batch-first)."""

    def __init__(self, fn: LocalAttentionFn, causal: bool, batch_dim_idx: int):
        super().__init__()
        self.fn, self.causal, self.batch_dim_idx = fn, causal, batch_dim_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.batch_dim_idx == 1:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = self.fn(q, k, v, causal=self.causal)
        return out.transpose(0, 1) if self.batch_dim_idx == 1 else out


class UserAttention(Attention):
    """The reference's attention (its projections, names, weights) through the user's function
    on every head and the whole sequence: DistributedAttention at SP=1, without DeepSpeed."""

    def __init__(self, ref: Attention, fn: LocalAttentionFn):
        nn.Module.__init__(self)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = ref.q_proj, ref.k_proj, ref.v_proj, ref.out_proj
        self.num_heads, self.num_kv_heads = ref.num_heads, ref.num_kv_heads
        self.head_dim, self.causal, self.fn = ref.head_dim, ref.causal, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, S, H)
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a_kv, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (B, S, a_kv, d)
        return self.out_proj(self.fn(q, k, v, causal=self.causal).reshape(b, s, -1))  # (B, S, H)


class DeepSpeedUlyssesAttention(nn.Module):
    """This rank's tokens -> DeepSpeed's DistributedAttention -> this rank's tokens."""

    def __init__(self, ref: UserAttention, dist_attn: nn.Module, batch_dim_idx: int, told_batch_dim_idx: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = ref.q_proj, ref.k_proj, ref.v_proj, ref.out_proj
        self.head_dim, self.batch_dim_idx, self.told = ref.head_dim, batch_dim_idx, told_batch_dim_idx
        self.dist_attn = dist_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, s_r, H)
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a_kv, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (B, s_r, a_kv, d)
        if self.batch_dim_idx == 1:  # DeepSpeed's seq-first layout: (s_r, B, a, d)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        y = self.dist_attn(q, k, v, self.told)  # DeepSpeed: same layout and shape as q
        if self.batch_dim_idx == 1:
            y = y.transpose(0, 1)  # (B, s_r, a, d)
        return self.out_proj(y.reshape(b, s, -1))  # (B, s_r, H)


class UlyssesGPT(nn.Module):
    """tokens, positions (B, s_r) -> logits (B, s_r, V); the reference's modules and names."""

    def __init__(self, ref: GPT):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = ref.tok_emb, ref.pos_emb, ref.blocks
        self.norm_f, self.lm_head = ref.norm_f, ref.lm_head

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, s_r, H): my tokens' global positions
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))  # (B, s_r, V)


def launcher_env(ctx: RankContext) -> None:
    """What DeepSpeed's launcher would have set and its engine asserts: LOCAL_RANK (this rank's
    device index on its host; on CPU the rank: the harness runs one host)."""
    local = ctx.device.index if ctx.device.type != "cpu" and ctx.device.index is not None else ctx.rank
    os.environ.setdefault("LOCAL_RANK", str(local))


def _init_distributed() -> None:
    """DeepSpeed's communication backend over the harness's already-initialized gloo world
    (it wraps torch.distributed: `TorchBackend`, which loads its shm op)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


def _sp_groups(ctx: RankContext):
    """DeepSpeed's own sequence-parallel groups (`parallel_state_sp.initialize_sequence_parallel`,
    made once per mesh in a rank process), checked to be the harness's SP group; None at SP 1
    (DeepSpeed refuses a sequence_parallel_size of 1: the engine is then plain DP)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as ps

    if ctx.tp == 1:
        return None
    made = ps._SEQUENCE_PARALLEL_GROUP
    if made is None or tuple(dist.get_process_group_ranks(made)) != ctx.tp_ranks or \
            ps.get_sequence_data_parallel_world_size() != ctx.world_size:
        ps._release_sequence_parallel_groups()
        ps.initialize_sequence_parallel(ctx.tp)
    theirs = tuple(dist.get_process_group_ranks(ps.get_sequence_parallel_group()))
    if theirs != ctx.tp_ranks:
        raise RuntimeError(f"DeepSpeed's SP group {theirs} is not the harness's {ctx.tp_ranks}")
    return ps


def _layout_indices(layout: str | None) -> tuple[int, int]:
    """(batch_dim_idx, the sequence dim DeepSpeed gathers) for the run's activation layout."""
    return (1, 0) if layout == "sbh" else (0, 1)


def _all_reduce_grads(module: nn.Module, ctx: RankContext) -> None:
    """The engine's stage-0 reduction written out (for float64, which the engine refuses): SUM
    over the SP x DP ranks, divided by DP."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dist.group.WORLD)
            p.grad.div_(ctx.dp)


def ulysses_shard(*, local_attention: LocalAttentionFn, scatter_idx: int = 2, gather_idx: int | None = None,
                  batch_dim_idx: int | None = None, grad_sync: str = "engine", mpu: bool = True,
                  ds_config: Mapping[str, Any] | None = None):
    """The sharded factory of a `ulysses_case`. `scatter_idx`, `gather_idx` are
    DistributedAttention's (None: the layout's sequence dim); `batch_dim_idx` is what its forward
    is told (None: the layout's); `mpu`: hand DeepSpeed's `parallel_state_sp` to the engine
    (False: the engine knows no SP group); `ds_config` merges into the engine's config."""

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        from deepspeed.utils import groups

        cfg = ctx.config
        launcher_env(ctx)
        # a warm rank process starts each job with DeepSpeed's groups as a new process has them:
        # an engine made with mpu=None keeps the mpu a previous job's engine installed (it only
        # ever sets `groups.mpu` when given one), and the uneven-heads all-to-all reads it
        groups.mpu = None
        ctx.once("deepspeed-init-distributed", _init_distributed)
        ps = _sp_groups(ctx)
        layout_bdi, seq_dim = _layout_indices(cfg.layout)
        told_bdi = layout_bdi if batch_dim_idx is None else batch_dim_idx
        for block in as_gpt(reference).blocks:
            attn = block.attn
            assert isinstance(attn, UserAttention)  # build_reference's
            local = LocalAttention(local_attention, attn.causal, layout_bdi)
            dist_attn = DistributedAttention(local, ctx.tp_group, scatter_idx=scatter_idx,
                                             gather_idx=seq_dim if gather_idx is None else gather_idx)
            block.attn = DeepSpeedUlyssesAttention(attn, dist_attn, layout_bdi, told_bdi)
        model = UlyssesGPT(as_gpt(reference))
        if grad_sync == "engine":
            config = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
                      "zero_optimization": {"stage": 0}, **(ds_config or {})}
            engine, *_ = deepspeed.initialize(model=model, config=config, mpu=ps if mpu else None)
            sync = engine.allreduce_gradients
        else:
            groups.mpu = ps if mpu else None  # as deepspeed.initialize installs it (uneven heads read it)
            sync = lambda: _all_reduce_grads(model, ctx)  # noqa: E731
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=model, input_layout=io, output_layout=io, input_layouts={"positions": io},
                       replicated=("*",), sync_grads=sync)

    return shard


def _setup() -> None:
    """Per process, outside any job's clock: DeepSpeed's import and its CPU comm op's JIT build
    (what `deepspeed.init_distributed` loads), under `build_extension_exclusively` so that a
    build killed mid-way (its torch `lock` left behind) does not hang every later setup."""
    import deepspeed  # noqa: F401
    import deepspeed.sequence.layer  # noqa: F401
    from deepspeed.comm.torch import build_shm_op

    build_extension_exclusively(SHM_OP_NAME, build_shm_op)


def ulysses_case(name: str, *, local_attention: LocalAttentionFn = sdpa_attention, scatter_idx: int = 2,
                 gather_idx: int | None = None, batch_dim_idx: int | None = None, grad_sync: str = "engine",
                 mpu: bool = True, ds_config: Mapping[str, Any] | None = None, **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `DistributedAttention` around `local_attention` (see
    `LocalAttentionFn`) in a small GPT, sequence-sharded over the run's SP group (every rank of a
    DP replica), against the same GPT with `local_attention` unsharded. The GPT's shapes are the
    case's defaults (--hidden, --num-heads, --num-kv-heads, --seq-len, ... override them).
    `grad_sync`: "engine" (DeepSpeed's engine, float32/bfloat16) or "all-reduce" (the same sums
    written out; float64 too). Other knobs: as `ulysses_shard`'s. `case_fields`: any other
    `Case` field (defaults, tags, isolation, examples, ...)."""
    if grad_sync not in ("engine", "all-reduce"):
        raise ValueError(f"ulysses_case({name!r}): grad_sync must be 'engine' or 'all-reduce', got {grad_sync!r}")
    case_fields.setdefault("setup", _setup)

    def validate(cfg) -> None:
        sp = cfg.world_size // cfg.dp
        a, a_kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        if cfg.hidden % a or a % a_kv:
            raise ValueError(f"num_heads({a}) must divide hidden({cfg.hidden}) and num_kv_heads({a_kv}) num_heads")
        if cfg.ring_degree not in (None, 1):
            raise Unsupported(f"DeepSpeed's DistributedAttention is pure Ulysses: ring_degree({cfg.ring_degree})")
        if cfg.load_balancer not in (None, "none"):
            raise Unsupported(f"DeepSpeed-Ulysses shards the sequence contiguously: load_balancer {cfg.load_balancer!r}")
        shards = tuple(cfg.seq_shards) if cfg.seq_shards is not None else None
        if cfg.seq_len % sp or (shards is not None and len(set(shards)) > 1):
            raise Unsupported(
                f"DeepSpeed's DistributedAttention exchanges equal all_to_all_single splits, so every rank "
                f"must hold seq_len / sp tokens: seq_len {cfg.seq_len}, sp {sp}"
                + (f", seq_shards {list(shards)}" if shards else "")
                + " (an uneven split silently corrupts the output: deepspeedai/DeepSpeed#7384)")
        if a_kv % sp and a_kv < sp:
            raise Unsupported(f"DeepSpeed: 'Number of key-value heads ({a_kv}) must be at least the sequence "
                              f"parallel size ({sp})' (deepspeed.sequence.layer._resolve_kv_heads)")
        if grad_sync == "engine" and cfg.dtype == "float64":
            raise Unsupported("DeepSpeed's engine reduces grads only in its accelerator's supported_dtypes "
                              "(float32, bfloat16, float16): 'attempting to reduce an unsupported grad type: "
                              "torch.float64'; a float64 check needs grad_sync='all-reduce'")

    def build_reference(cfg) -> nn.Module:
        model = build_gpt(gpt_config(cfg), seed=cfg.seed)
        for block in model.blocks:
            block.attn = UserAttention(attention_of(block), local_attention)
        return model

    def make_batch(cfg, step, gen) -> Batch:
        return with_positions(*gpt_batch(cfg, step, gen))

    defaults = {**GPT_DEFAULTS, "dtype": "float32" if grad_sync == "engine" else "float64",
                **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} DistributedAttention (Ulysses) around "
                                       f"{getattr(local_attention, '__name__', 'a local attention')}, grads by {grad_sync}",
                build_reference=build_reference, make_batch=make_batch,
                shard=ulysses_shard(local_attention=local_attention, scatter_idx=scatter_idx, gather_idx=gather_idx,
                                    batch_dim_idx=batch_dim_idx, grad_sync=grad_sync, mpu=mpu, ds_config=ds_config),
                loss_sum=token_loss_sum, tokens=gpt_tokens, input_layout=Layout(seq_dim=1, batch_dim=0),
                validate=validate, defaults=defaults,
                tags=("deepspeed", "ulysses", "framework", *case_fields.pop("tags", ())), **case_fields)



# --- UlyssesSPAttentionHF (Arctic Long Sequence Training) on a tiny HF Llama ------------------------

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
"""A tiny `LlamaConfig` (2 layers, hidden 32, 4 heads, vocab 64); initializer_range 0.2 so the
logits are far from uniform at init (HF's 0.02 gives near-zero grads)."""


class CausalLMLogits(nn.Module):
    """An HF causal LM called on named tensors, returning its logits (B, S, V) (the harness
    judges tensors; HF returns a ModelOutput). The LM's params keep their names under `lm.`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


_ORIGINAL_ATTENTION: dict[str, Any] = {}


def _register_ulysses_hf(model: nn.Module, *, core: str, sp: int, batch: int, seq_len: int):
    """DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` for this job. It replaces
    transformers' global `ALL_ATTENTION_FUNCTIONS[core]` by its wrapper and makes DeepSpeed's SP
    groups; a warm rank process's next job first puts back transformers' own function and
    releases the groups, so every job registers exactly once over the plain attention, as a
    new process would (the references run in processes this never touches)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as ps
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ORIGINAL_ATTENTION.setdefault(core, ALL_ATTENTION_FUNCTIONS[core])
    ALL_ATTENTION_FUNCTIONS[core] = _ORIGINAL_ATTENTION[core]
    ps._release_sequence_parallel_groups()
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=core, sequence_parallel_size=sp,
        micro_batch_size=batch, seq_length=seq_len, seq_length_is_variable=False)


def _hf_setup() -> None:
    """Per process: DeepSpeed's setup plus transformers' Llama import."""
    _setup()
    import transformers.models.llama.modeling_llama  # noqa: F401


def hf_ulysses_case(name: str, llama_config: Mapping[str, Any] | None = None, *, core_attn: str = "sdpa",
                    **case_fields: Any) -> Case:
    """A `Case` checking DeepSpeed's `UlyssesSPAttentionHF` (registered with transformers by its
    `register_with_transformers`, `core_attn` its core attention) on an HF `LlamaForCausalLM`
    built from `llama_config` (LlamaConfig keywords over `TINY_LLAMA`; its shapes become the
    case's defaults, which --hidden, --num-heads, ... override), sequence-sharded
    over the run's SP group, against the same model unsharded. Grads: DeepSpeed's engine with the
    mpu `register_with_transformers` returns (float32 / bfloat16, as `ulysses_case`). The loss is
    the harness's token cross entropy on the logits (HF's own shifted loss is not used: the
    targets are already the next tokens)."""
    kwargs = {**TINY_LLAMA, **(llama_config or {})}
    case_fields.setdefault("setup", _hf_setup)

    def llama(cfg, dtype):
        from transformers import LlamaConfig, LlamaForCausalLM

        shapes = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
                      max_position_embeddings=max(64, cfg.seq_len))
        torch.manual_seed(cfg.seed)
        config = LlamaConfig(**{**kwargs, **shapes}, attn_implementation=core_attn)
        return CausalLMLogits(LlamaForCausalLM(config).to(dtype))

    def validate(cfg) -> None:
        sp = cfg.world_size // cfg.dp
        a, a_kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
        if cfg.seq_len % sp or (cfg.seq_shards is not None and len(set(cfg.seq_shards)) > 1):
            raise Unsupported(f"UlyssesSPAttentionHF needs seq_len / sp tokens on every rank (its required_query_shape): "
                              f"seq_len {cfg.seq_len}, sp {sp}")
        if sp > 1 and (a % sp or (a_kv % sp and sp % a_kv)):
            raise Unsupported(f"UlyssesSPAttentionHF: num_attention_heads ({a}) must be divisible by sp ({sp}), and "
                              f"num_key_value_heads ({a_kv}) divisible by sp or sp by it")
        if cfg.layout not in (None, "bsh") or cfg.ring_degree not in (None, 1) or \
                cfg.load_balancer not in (None, "none") or cfg.causal is False:
            raise Unsupported("UlyssesSPAttentionHF on an HF Llama: [b, s, h] inputs, causal, pure Ulysses, contiguous")
        if cfg.dtype == "float64":
            raise Unsupported("DeepSpeed's engine reduces grads only in its accelerator's supported_dtypes "
                              "(float32, bfloat16, float16): 'attempting to reduce an unsupported grad type: torch.float64'")

    def shard(reference: nn.Module, ctx: RankContext) -> Sharded:
        import deepspeed
        from deepspeed.utils import groups

        cfg = ctx.config
        launcher_env(ctx)
        groups.mpu = None
        ctx.once("deepspeed-init-distributed", _init_distributed)
        mpu = _register_ulysses_hf(reference.get_submodule("lm"), core=core_attn, sp=ctx.tp,
                                  batch=known(cfg.batch, "batch"), seq_len=known(cfg.seq_len, "seq_len"))
        if mpu is not None and tuple(dist.get_process_group_ranks(mpu.get_sequence_parallel_group())) != ctx.tp_ranks:
            raise RuntimeError(f"DeepSpeed's SP group {dist.get_process_group_ranks(mpu.get_sequence_parallel_group())} "
                               f"is not the harness's {ctx.tp_ranks}")
        config = {"train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 0}}
        engine, *_ = deepspeed.initialize(model=reference, config=config, mpu=mpu)
        io = Layout(seq_dim=1, batch_dim=0)
        return Sharded(module=reference, input_layout=io, output_layout=io, input_layouts={"position_ids": io},
                       replicated=("*",), sync_grads=engine.allreduce_gradients)

    def make_batch(cfg, step, gen) -> Batch:
        made = with_positions(*gpt_batch(cfg, step, gen))
        return Batch(inputs={"input_ids": made.inputs["tokens"], "position_ids": made.inputs["positions"]},
                     target=made.target)

    shapes = dict(vocab=kwargs["vocab_size"], hidden=kwargs["hidden_size"], ffn=kwargs["intermediate_size"],
                  num_layers=kwargs["num_hidden_layers"], num_heads=kwargs["num_attention_heads"],
                  num_kv_heads=kwargs["num_key_value_heads"])
    defaults = {**GPT_DEFAULTS, **shapes, "dtype": "float32", **case_fields.pop("defaults", {})}
    return Case(name=name, description=f"DeepSpeed {DEEPSPEED_VERSION} UlyssesSPAttentionHF ({core_attn}) on an HF Llama",
                build_reference=lambda cfg: llama(cfg, torch.float64), make_batch=make_batch, shard=shard,
                loss_sum=token_loss_sum, tokens=gpt_tokens, input_layout=Layout(seq_dim=1, batch_dim=0),
                validate=validate, defaults=defaults,
                tags=("deepspeed", "ulysses", "transformers", "framework", *case_fields.pop("tags", ())), **case_fields)


__all__ = ["DEEPSPEED_VERSION", "TINY_LLAMA", "CausalLMLogits", "LocalAttention", "detached", "hf_ulysses_case", "launcher_env", "sdpa_attention", "ulysses_case",
           "ulysses_shard"]
