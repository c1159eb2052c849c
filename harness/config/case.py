"""Stage: config. The public case API: what a case declares and how the engine reads it.

A case is a system under test: how to build the single-device reference, how to make one
step's global input, and how to turn a copy of the reference into the sharded model on one rank.
A DTensor plan needs nothing more (parameter mapping is read off the DTensor placements); hand
written layers also say how their parameters map to the reference's names (`ParamSpec`).

Verdict rules: a case that cannot handle a config raises `Unsupported` from `validate` (run in
the driver, before any rank does anything): that is UNSUPPORTED, not a failure. Anything else
that goes wrong, wrong numbers, a hang or a crash in the parallel code, is FAIL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from sp_harness.config.check_config import ENGINE_DEFAULTS, KNOBS, CheckConfig, default_timeout_s
from sp_harness.config.gpt_knobs import GPTKnobs
from sp_harness.config.rank_context import RankContext
from sp_harness.config.resources import require_memory
from sp_harness.config.step_protocol import TrainLoss, TrainStep


class Unsupported(Exception):
    """Raised by `Case.validate` for a config the case declares it cannot handle."""


class ParamMappingError(ValueError):
    """A local param whose shape contradicts its mapping (`ParamSpec`, or the framework's own
    sharding metadata) where the shape alone does not say where it lives: a user error, raised on
    a rank while the params are mapped, before anything is judged. The check raises it again in
    the driver with the rank's one-line message (sp_harness.checks.side_by_side.run_job, by its
    class name): one line naming the param, exit 2."""


@dataclass(kw_only=True, frozen=True)
class Layout:
    """Where a tensor's sequence and batch dims are, and whether the sequence is sharded."""

    seq_dim: int | None = None
    """Dim holding the sequence; None if the tensor has none (a scalar loss, say)."""
    batch_dim: int | None = None
    """Dim split across DP replicas; None if the tensor has no batch dim (then dp must be 1)."""
    seq_sharded: bool = True
    """True: each TP rank holds its own slice of `seq_dim` (SP). False: replicated over TP."""
    seq_order: Callable[[int, tuple[int, ...]], torch.Tensor] | None = None
    """Load-balanced placement (context parallelism): (seq_len, seq_shards) -> a permutation of
    the global positions 0..seq_len-1 (int64), applied along `seq_dim` before the contiguous cut
    by `seq_shards`, so TP rank r holds positions order[off_r : off_r + seq_shards[r]] in that
    order (zigzag: rank i holds chunks i and 2W-1-i). None: the identity (contiguous shards).
    A permuted piece's reported offset on `seq_dim` is 0: its rows are not one global range."""
    split_dim: int | None = None
    """A dim other than the sequence split across the TP group (vocab-parallel logits: the vocab
    dim), by torch.chunk's sizes unless `split_sizes` says otherwise. The output is then judged
    piecewise; the target is cut on the batch and sequence dims only (labels have no vocab dim).
    An output with a split dim has no default loss (`Sharded.local_loss` is required) and its
    loss is not summed over TP: every TP rank holds the whole loss, as a vocab-parallel cross
    entropy does after its all-reduces. Needs `seq_sharded=False` where there is a `seq_dim`."""
    split_sizes: tuple[int, ...] | None = None
    """Per-TP-rank sizes along `split_dim` (a padded or uneven vocab split); None: torch.chunk's."""

    def __post_init__(self) -> None:
        if self.split_sizes is not None and self.split_dim is None:
            raise ValueError(f"Layout.split_sizes {list(self.split_sizes)} needs a split_dim")
        if self.split_dim is not None and self.seq_dim is not None and self.seq_sharded:
            raise ValueError(f"Layout(seq_dim={self.seq_dim}, split_dim={self.split_dim}) would split both the "
                             f"sequence and dim {self.split_dim} across the one TP group; a vocab-parallel output "
                             f"holds the whole sequence: add seq_sharded=False")


@dataclass(kw_only=True, frozen=True)
class Batch:
    """One step's global data, as `Case.make_batch` returns it (a plain `(input, target)` tuple is
    read as a single positional input)."""

    inputs: Mapping[str, Any]
    """The model's inputs by keyword: tokens, positions, an attention mask, ... The reference is
    called as `model(**inputs)` on the whole batch, the sharded module as `module(**pieces)` on
    this rank's pieces (cut by `Sharded.input_layouts`, else `Sharded.input_layout`). A non-tensor
    value (a mask spec, a callable) reaches both sides unchanged: not cut, no grad; the sharded
    side can turn it into this rank's own (`Sharded.prepare_inputs`)."""
    target: torch.Tensor
    """The labels: what `Case.loss_sum` compares the output with."""
    positional: bool = False
    """Call the models with the single input positionally (the tuple form)."""


def as_batch(made: Batch | tuple[torch.Tensor, torch.Tensor]) -> Batch:
    if isinstance(made, Batch):
        return made
    inp, tgt = made
    return Batch(inputs={"input": inp}, target=tgt, positional=True)


@dataclass(kw_only=True, frozen=True)
class ParamSpec:
    """How one local (non-DTensor) parameter maps onto the reference's parameter."""

    ref_name: str
    """Name of the reference parameter this local one is (a piece of)."""
    dim: int | None = None
    """Dim the reference parameter is split on across the TP group; None means replicated."""
    sizes: tuple[int, ...] | None = None
    """Per-TP-rank sizes along `dim`; None means torch.chunk's split."""
    index: Callable[[torch.Tensor], torch.Tensor] | None = None
    """For layouts a plain split cannot express (fused, permuted or strided weights): a function
    from the full reference tensor to a VIEW of it holding this rank's local elements. Overrides
    dim/sizes. The view has the local param's shape, or another shape with the local param's
    number of elements in the local param's (row-major) order: a strided split whose reference dim
    0 is `s` equal blocks, each chunked over TP (a fused [gate; up] weight), is
    `lambda full: full.view(s, D // s, *rest)[:, r * c:(r + 1) * c]`. The engine reshapes it to the
    local shape where it compares, and writes the local param through it where it assembles the
    reference (`view.copy_(local.reshape(view.shape))`): a copy instead of a view is an error."""
    replicated: bool | None = None
    """Whether this local param must stay bit-identical across the TP group; None: replicated
    exactly when it is neither split (`dim`) nor indexed (`index`). Set True for an indexed
    param that every TP rank holds whole (a permuted copy, say), so it keeps its replica check."""
    finding: str = ""
    """Where this spec was read off the param's shape because the declared mapping (the case's
    spec, the framework's sharding metadata) contradicts it (`by_shape`): what the metadata says
    and what the shape says, naming the param. Reported in the result (`CheckResult.findings`),
    not judged: the check goes on with this spec."""

    @property
    def replicated_tp(self) -> bool:
        if self.replicated is not None:
            return self.replicated
        return self.dim is None and self.index is None


def split_dim_by_shape(name: str, local: tuple[int, ...], whole: tuple[int, ...], tp: int, declared: str) -> int:
    """The dim along which local shape `local` is one contiguous TP chunk of the reference's
    `whole` (torch.chunk's split over `tp` ranks, rank r's chunk r), read from the shapes alone:
    exactly one dim differs and local x tp == whole along it. Else `ParamMappingError` naming
    param `name` and what its metadata says (`declared`): the shapes do not say where it lives."""
    why = ""
    differ = [d for d, (a, b) in enumerate(zip(local, whole, strict=False)) if a != b]
    if len(local) != len(whole):
        why = f"{len(local)} dims against {len(whole)}"
    elif tp == 1:
        why = "no TP group to be a piece of (TP 1)"
    elif len(differ) != 1:
        why = f"{len(differ)} dims differ"
    elif local[differ[0]] * tp != whole[differ[0]]:
        why = f"dim {differ[0]} is {local[differ[0]]} of {whole[differ[0]]}, not 1/{tp} (TP {tp})"
    if why:
        raise ParamMappingError(
            f"param {name}: local {tuple(local)} of the reference's {tuple(whole)}, but {declared}; its shape does not "
            f"say which piece it is ({why}): declare its split (ParamSpec dim, sizes or index)")
    return differ[0]


def by_shape(ref_name: str, local: tuple[int, ...], whole: tuple[int, ...], tp: int, declared: str) -> ParamSpec:
    """A spec for a param whose declared mapping (`declared`: what the case's spec or the
    framework's metadata says, e.g. "not flagged tensor-parallel: megatron treats it as
    replicated in the clip norm") contradicts its shape: split where `split_dim_by_shape` says,
    the contradiction kept as its `finding`. The engine's judging then says whether the
    contiguous chunk it assumed is the param's (its init and forward checks)."""
    dim = split_dim_by_shape(ref_name, local, whole, tp, declared)
    return ParamSpec(ref_name=ref_name, dim=dim, finding=(
        f"{ref_name}: local {tuple(local)} of {tuple(whole)} but {declared}; mapped by its shape as a "
        f"contiguous TP chunk of dim {dim}"))


@dataclass
class Sharded:
    """One rank's sharded model and how the engine reads it. Returned by `Case.shard`."""

    module: nn.Module
    """The sharded model; called on this rank's piece of the input."""
    input_layout: Layout
    """How the global input is cut for this rank (every input, unless `input_layouts` names it)."""
    output_layout: Layout
    """How this rank's output relates to the reference's output."""
    input_layouts: Mapping[str, Layout] = field(default_factory=dict)
    """Per named input (`Batch.inputs`), where it differs from `input_layout`: positions cut like
    the tokens, an attention mask not cut at all (`Layout(seq_sharded=False)`), ..."""
    params: Mapping[str, ParamSpec] = field(default_factory=dict)
    """Local parameter name -> spec. DTensor params need no entry; plain params need one each,
    unless listed in `replicated` (the engine never guesses a mapping from names)."""
    replicated: tuple[str, ...] = ()
    """Local names of plain params that are replicated copies of the reference param of the
    same name (each is checked bit for bit across the TP group). `"*"` declares every plain
    param without a spec so."""
    whole_outputs: tuple[str, ...] = ()
    """Modules (as `module` names them) that hold TP-sharded params yet return a complete tensor,
    the reference's whole or this rank's sequence slice of it, because the framework reduces
    inside them and says so (torchtitan's declared output types under spmd_types: a
    vocab-parallel embedding's `P` output reduce-scattered to `S(1)`): their output is traced and
    compared (their input grad is not: it may be a piece). Plain-tensor models only; a DTensor
    output says this itself."""
    sync_grads: Callable[[], None] = lambda: None
    """Called after backward, before the optimizer step: the grad all-reduces a hand-written
    implementation owes (norm weights under SP, DP averaging). Part of the system under test."""
    local_loss: Callable[[torch.Tensor, torch.Tensor, RankContext], torch.Tensor] | None = None
    """This rank's share of the loss from its local output and target; None means the engine's
    default (token-loss sum over local tokens / tokens per DP replica). The global loss is the
    mean over DP of the sum over TP of these shares where the output's sequence is sharded; where
    it is not (`seq_sharded=False`, or a `split_dim` output: a vocab-parallel cross entropy) every
    TP rank returns the whole loss of its replica and it is not summed. It is what each rank's
    backward starts from. Part of the system under test: a wrong weighting here is a real bug."""
    clip_grad_norm: Callable[[float], torch.Tensor] | None = None
    """Optional: global grad-norm clipping as this implementation does it; returns the norm."""
    prepare_inputs: Callable[[dict[str, Any], RankContext], Mapping[str, Any]] | None = None
    """Builds what the sharded module is called with from this rank's input pieces: a per-rank
    attention mask (torchtitan's BlockMask for the local sequence) from a spec in `Batch.inputs`,
    say. The pieces it is given stay the grad leaves that are judged. Part of the system under test."""
    train_step: TrainStep | None = None
    """The implementation's own training step (sp_harness.config.step_protocol.TrainStep), for a case
    that declares `Case.train_loss`: what the training-step check runs instead of the engine's
    step. Part of the system under test."""
    grad_attr: str = "grad"
    """The param attribute the implementation leaves its final grads in ("main_grad" for
    megatron-core's DDP): the grad check reads it, and before the engine's optimizer step it is
    copied into `.grad` (cast to the param's dtype), then zeroed in place after the step, as
    megatron's zero_grad_buffer does."""


@dataclass(kw_only=True, frozen=True)
class Example:
    """One config the main job (`sp-harness nightly`) checks a case on, with why it is there."""

    fields: tuple[tuple[str, Any], ...]
    """CheckConfig fields besides the case, as pairs: (("world_size", 3), ("seq_len", 10))."""
    note: str
    """What this config exercises (uneven heads, a 2 x 2 mesh, an upstream failure, ...)."""

    def config(self, case: str) -> CheckConfig:
        return CheckConfig(case=case, **dict(self.fields))


@dataclass(kw_only=True, frozen=True)
class Training:
    """How a case trains in a lockstep convergence run (`sp-harness converge`). Every run of one
    convergence job (reference, baseline, case) trains on the case under test's stream."""

    batches: Callable[[CheckConfig, int, int], Batch | tuple[torch.Tensor, torch.Tensor]] | None = None
    """(config, step, data_seed) -> one step's global batch (a `Batch` or `(input, target)`), a
    function of its arguments only: every rank and every run must draw the same batch. None: the
    case's own `make_batch(config, step, generator)`, the generator seeded from (data_seed, step)."""
    loss_floor: Callable[[CheckConfig, int], float | None] = lambda config, data_seed: None
    """(config, data_seed) -> the data's ideal mean loss where it is known (a Markov chain's
    entropy rate; a teacher-plus-noise regression's noise variance), else None. Drawn in the
    report and summarised as each run's distance to it; never gated."""
    floor_label: str = "the data's ideal loss"
    """What the floor is, for the report's legend and captions."""
    seq_len: int | None = None
    """Tokens per sequence a convergence run uses unless told (`--seq-len`); None: the case's
    check default (`Case.defaults`)."""
    batch: int | None = None
    """Sequences per DP replica and step a convergence run uses unless told; None: the case's
    check default."""


@dataclass(kw_only=True, frozen=True)
class Case:
    """A system under test: reference + sharded twin + data."""

    name: str
    """Registry name, e.g. 'megatron-gpt-sp'."""
    description: str
    """One line shown by `sp-harness list`."""
    build_reference: Callable[[CheckConfig], nn.Module] | Callable[[CheckConfig, RankContext], nn.Module]
    """Single-device model in float64, deterministic in config.seed (global RNG untouched). A
    factory that takes a second argument gets the reference's own rank context (a framework's
    TP=1 reference makes its one-rank state from it)."""
    make_batch: Callable[[CheckConfig, int, torch.Generator], Batch | tuple[torch.Tensor, torch.Tensor]]
    """(config, step, generator) -> one step's global `Batch` (named inputs and target), or the
    short form `(input, target)`; float64 or int tensors."""
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Sum of per-token losses of an output and its target (any matching slices)."""
    tokens: Callable[[torch.Tensor], int]
    """Number of loss terms in a target tensor (the divisor of the mean loss)."""
    shard: Callable[[nn.Module, RankContext], Sharded]
    """Turn this rank's copy of the reference (already in the run dtype) into the sharded model."""
    validate: Callable[[CheckConfig], None] = lambda config: None
    """Raise `Unsupported` (clear message with the numbers) for configs the case cannot handle,
    ValueError for configs that make no sense. Runs in the driver before any rank starts."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values for the config fields left as None: shapes (seq_len, hidden, ...) and any engine
    default (steps, batch, dtype, lr, optimizer, norm, layout); names that are neither a run
    field nor one of this case's `knobs` are an error."""
    knobs: type | None = GPTKnobs
    """The knob dataclass whose fields this case reads beyond the run fields (`GPTKnobs`: model
    shape, attention, placement, norm, layout): each field is a `sp-harness check` flag and a
    `CheckConfig` field, generated from that one declaration; `CheckConfig.knob_values` gives a
    case its knobs as one object. A knob class must be one `CheckConfig` carries
    (`sp_harness.config.check_config.KNOBS`). None: the case reads no knobs."""
    input_layout: Layout = Layout(seq_dim=0)
    """Layout of the global input and target: where seq and batch dims are."""
    replicated_hint: tuple[str, ...] = ()
    """Reference names the case says must stay bit-identical across ranks (beyond those the
    engine infers: every replicated parameter)."""
    tags: tuple[str, ...] = ()
    """Free labels: 'dtensor', 'megatron', 'mutant', 'upstream-bug', ..."""
    models_bug: str = ""
    """For mutants: the real bug this models, with its public reference."""
    source: str = ""
    """For a mutant: where the bug it models was shipped, reported or fixed (PR, issue, paper)."""
    twin: str = ""
    """For a mutant: the correct case it is a variation of (a battery entry only counts as a kill
    if the twin passes it)."""
    killed_by: tuple[str, ...] = ()
    """For a catalogue mutant: (the check that must kill it first, as the battery's table names
    it, the battery entry), e.g. ("grad", "even"): its pin, declared where it is defined and
    asserted by tests/test_mutants.py (sp_harness.suites.battery)."""
    baseline: str = ""
    """The case this one is compared with beyond the reference: an SP case's tensor-parallel
    twin (its communication volume and its training curve), '' for none."""
    expect: Callable[[CheckConfig], str] | None = None
    """The verdict this case should reach on a resolved, validated config ('PASS' or 'FAIL'):
    where upstream code is pinned to what it does. None: PASS (a correct case)."""
    examples: tuple[Example, ...] = ()
    """The configs the main job checks this case on (each against its expected verdict)."""
    training: Training | None = None
    """How convergence runs train this case; None: `Training()`, the case's own `make_batch`
    stream with no known loss floor."""
    isolation: Literal["shared", "own"] | str | None = None
    """Which rank processes run this case's jobs. "own": processes no other case has used (a
    fresh pool per case and world size, started on its first job): whatever the case changes
    process-wide (a monkeypatched library, a framework's globals) cannot change another case's
    verdict. "shared": the case promises to change no process-wide state and shares processes
    with the other shared cases. Any other name (say "megatron-core"): processes shared only with
    the cases that give the same name (one framework's cases, which change the same globals in
    the same way). None: "shared" for the built-in cases, whose code is this project's, "own"
    for every other (a user's case file, a framework's)."""
    memory_floor: Callable[[CheckConfig], int] | None = None
    """(resolved config) -> a lower bound, in bytes, of one reference process's peak (the float64
    reference and its perturbed twin with their grads, the activations their backward keeps).
    Checked before any rank starts (`Case.resolve`): a config whose floor exceeds the machine's
    memory is a setup error (exit 2) naming both, not a run that ends in a FAIL or the OOM
    killer. None: not estimated."""
    setup: Callable[[], None] | None = None
    """Run once per rank process (and reference process) before the case's first job there,
    outside the job's timeout (its own budget: sp_harness.launch.case_setup.SETUP_TIMEOUT_S): a
    framework's first-use work, such as a C++ op JIT-built on first import. It raising, or
    running past its budget, is a setup error (exit 2), not a FAIL."""
    preload: tuple[str, ...] = ()
    """What the rank fork server (sp_harness.launch.zygote_server) imports before it forks this
    case's ranks and their reference processes, in order, so that each does not import it again:
    a framework's package (seconds per process). Each entry is a module name, or
    "module:function" for a function it then calls with no argument (a CPU shim that must precede
    an import). Every entry must start no thread and dispatch no torch op beyond making a tensor
    from a Python scalar (the fork server's rule: zygote_server.PRELOAD_ENV). Cases naming the
    same entries share that fork server. Each process also loads them before `setup`
    (sp_harness.launch.case_setup: a no-op after the fork server's, the import where there was
    none: GPU pools, fresh interpreters), so a case states its imports here once and keeps
    `setup` for other first-use work."""
    train_loss: TrainLoss | None = None
    """The loss this case's own training step means (sp_harness.config.step_protocol.TrainLoss); its
    `shard` then sets `Sharded.train_step`. None: the case declares no training step (the
    training-step check is a setup error for it)."""
    precision_islands: Mapping[str, str] = field(default_factory=dict)
    """Module-name prefix in the reference -> dtype name ('float32', 'bfloat16', ...): modules
    that compute at that precision whatever their tensors' dtype says, for kernels whose internal
    precision the engine cannot see (a fused GPU kernel). The perturbed reference rounds their
    ops, forward and backward, at that dtype's eps, and the report lists them as declared. Ops
    whose tensors are of a coarser dtype than the run's need no entry: they are found."""

    def resolve(self, config: CheckConfig) -> CheckConfig:
        """Fill the config's None fields: the case's defaults first, then the engine's."""
        # explicit shards fix the sequence length before any default can
        if config.seq_len is None and config.seq_shards is not None:
            config = config.replace(seq_len=sum(config.seq_shards))
        defaults = {**ENGINE_DEFAULTS, "timeout_s": default_timeout_s(), **self.defaults}
        filled = {k: v for k, v in defaults.items() if getattr(config, k, None) is None}
        config = config.replace(**filled) if filled else config
        if self.memory_floor is not None:
            require_memory(self.memory_floor(config), f"case {self.name} [{config.short()}]")
        return config

    def __post_init__(self) -> None:
        if self.knobs is not None and self.knobs not in KNOBS:
            raise ValueError(f"case {self.name}: knobs {self.knobs.__name__} is not a knob class CheckConfig carries "
                             f"({', '.join(k.__name__ for k in KNOBS)}); add it to CheckConfig's bases")
        others = {f.name for k in KNOBS if k is not self.knobs for f in dataclasses.fields(k)}
        unknown = sorted(set(self.defaults) - ({f.name for f in dataclasses.fields(CheckConfig)} - others))
        if unknown:
            raise ValueError(f"case {self.name}: defaults for unknown config fields {unknown}")
        fixed = sorted(set(self.defaults) & {"case", "world_size", "dp", "seq_shards", "timeout_s"})
        if fixed:
            raise ValueError(f"case {self.name}: {fixed} describe the run, not the case; they cannot default")
        bad = [e for e in self.preload if not isinstance(e, str) or not e or "," in e or e.count(":") > 1]
        if bad or not isinstance(self.preload, tuple):
            raise ValueError(f"case {self.name}: preload {bad or self.preload!r}: a tuple of module names or "
                             f"'module:function' strings, without commas")
        for prefix, name in self.precision_islands.items():
            if not isinstance(prefix, str):
                raise ValueError(f"case {self.name}: precision_islands keys are module-name prefixes, got {prefix!r}")
            island_dtype(name, f"case {self.name}: precision_islands[{prefix!r}]")


ISLAND_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
"""The dtype names a precision island may be declared in."""


def island_dtype(name: str, what: str = "precision island dtype") -> torch.dtype:
    """The torch dtype a declared precision island computes in, by name (ValueError if none)."""
    if name not in ISLAND_DTYPES or not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"{what}: {name!r} is not a dtype an island can compute in; "
                         f"valid: {', '.join(ISLAND_DTYPES)}")
    return getattr(torch, name)


SHARED_PROCESSES = "sp-harness"
"""The isolation key of the cases that share rank processes."""


def isolation_key(case: Case) -> str:
    """The key a runner keys its rank processes by for `case` (see `Case.isolation`)."""
    mode = case.isolation
    if mode is None:
        # a case from a user's file (`path.py:NAME`) loads that file, and runs its top level, in
        # whatever process runs it: its own, whoever wrote its `shard`
        ours = [getattr(fn, "__module__", "").startswith("sp_harness.") for fn in (case.shard, case.setup) if fn]
        builtin = ".py:" not in case.name and all(ours)
        mode = "shared" if builtin else "own"
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"case {case.name}: isolation must be 'shared', 'own', a group name or None, got {mode!r}")
    if mode == "shared":
        return SHARED_PROCESSES
    return "case:" + case.name if mode == "own" else "group:" + mode
