"""Stage: step -> capture -> record (training). Lockstep convergence runs of a case.

Three runs of one model from one initial state on one stream of batches: the single-device
reference, the tensor-parallel baseline and the case under test (TP + SP). Each sharded run
trains a reference copy alongside it on every rank, so max |param - reference param| is known
at every step; the reference's own curve is recorded from that copy, so the same command works
under torchrun, where there is no one-rank world to run it in. Per step and run the records hold
loss, grad norm (replicated parameters counted once), LR, the cross-rank drift of every
replicated parameter, the distance to the reference, step time and tokens/s (JSONL, full
precision). Batches come from a fixed random Markov chain whose entropy rate is the loss floor.

State lives in the rank processes between jobs, so the driver advances training in chunks and
shows progress; under `torchrun -m sp_harness.suites.converge` every rank runs the same chunks in-process.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sp_harness.config.case import get_case
from sp_harness.config.check_config import CheckConfig
from sp_harness.record.records import StepRecord
from sp_harness.step.data import MarkovChain

DEFAULT_REFERENCE = "megatron-gpt-ref"
DEFAULT_BASELINE = "megatron-gpt-tp"


@dataclass(kw_only=True, frozen=True)
class TrainSpec:
    """One training run, as shipped to every rank."""

    run: str
    """Run name in the records: 'tp', 'sp', ..."""
    config: CheckConfig
    """Case, mesh, shapes, dtype, seed, lr, optimizer (seq_len/batch per DP replica)."""
    steps: int
    """Optimizer steps in total."""
    warmup_steps: int = 10
    """Linear LR warmup, then cosine decay to 10% of lr at the last step."""
    clip_grad_norm: float | None = None
    """Clip the global grad norm to this value; None: no clipping."""
    vocab: int = 64
    """Markov chain states = the model's vocabulary."""
    concentration: float = 0.1
    """Dirichlet concentration of the chain's rows: lower is more predictable (lower floor)."""
    data_seed: int = 1234
    """Seeds the chain and the batch stream, independently of the weights' seed."""


def lr_at(spec: TrainSpec, step: int) -> float:
    base = spec.config.lr
    if step < spec.warmup_steps:
        return base * (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(chain: MarkovChain, spec: TrainSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.data_seed * 1_000_003 + step)
    cfg = spec.config
    return chain.sample(cfg.dp * cfg.batch, cfg.seq_len, gen)


# ---- rank side -----------------------------------------------------------------------------

_STATE: dict = {}


def _grad_norm_sq_local(params, ctx) -> torch.Tensor:
    """This rank's share of the squared global grad norm: sharded pieces in full, replicated
    params only on TP rank 0 so that the TP sum counts each once."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.param.grad
        if g is None:
            continue
        g = p.local(g)
        if p.replicated_tp and ctx.tp_rank != 0:
            continue
        total += g.detach().to(torch.float64).pow(2).sum()
    return total


def train_start(spec: TrainSpec) -> dict:
    from sp_harness.step.build import build
    from sp_harness.step.optim_ref import make_optimizer

    config = spec.config
    built = build(config, reference_dtype=config.torch_dtype)
    case, ctx, ref, sharded, params, device = (built.case, built.ctx, built.reference, built.sharded, built.params,
                                               built.device)
    _STATE.clear()
    _STATE.update(
        spec=spec, case=case, ctx=ctx, ref=ref, sharded=sharded, params=params, device=device,
        opt=make_optimizer(config.optimizer, config.lr, sharded.module.parameters()), ref_opt=make_optimizer(config.optimizer, config.lr, ref.parameters()),
        ref_params=dict(ref.named_parameters()), step=0,
        chain=MarkovChain.from_seed(vocab=spec.vocab, seed=spec.data_seed, concentration=spec.concentration),
    )
    return {"num_params": sum(p.numel() for p in ref.parameters())}


def _set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def train_steps(num_steps: int) -> list[dict]:
    """Advance `num_steps`; returns (on every rank) the records of the runs for those steps."""
    from sp_harness.config.case import Batch
    from sp_harness.step.inputs import forward_loss, global_loss, rank_batch
    from sp_harness.step.params import replica_drift

    s = _STATE
    spec, case, ctx, sharded, params = s["spec"], s["case"], s["ctx"], s["sharded"], s["params"]
    ref, device = s["ref"], s["device"]
    out: list[dict] = []
    for _ in range(num_steps):
        step = s["step"]
        lr = lr_at(spec, step)
        inp, tgt = (t.to(device) for t in batch_at(s["chain"], spec, step))
        tokens = tgt.numel()

        # the reference alongside: one device, the global batch
        t0 = time.perf_counter()
        ref_loss = case.loss_sum(ref(inp), tgt) / case.tokens(tgt)
        ref_loss.backward()
        ref_norm = torch.sqrt(sum(p.grad.detach().double().pow(2).sum() for p in ref.parameters() if p.grad is not None))
        if spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), spec.clip_grad_norm)
        _set_lr(s["ref_opt"], lr)
        s["ref_opt"].step()
        s["ref_opt"].zero_grad(set_to_none=True)
        ref_time = time.perf_counter() - t0

        t0 = time.perf_counter()
        batch = Batch(inputs={"input": inp}, target=tgt, positional=True)
        local = rank_batch(batch, sharded, ctx, spec.config.torch_dtype)
        _, loss = forward_loss(case, sharded, local, tgt, ctx)
        loss.backward()
        sharded.sync_grads()
        norm_sq = _grad_norm_sq_local(params, ctx)
        if ctx.tp > 1:
            dist.all_reduce(norm_sq, group=ctx.tp_group)
        grad_norm = float(norm_sq.sqrt())
        if spec.clip_grad_norm is not None:
            if sharded.clip_grad_norm is not None:
                sharded.clip_grad_norm(spec.clip_grad_norm)
            else:
                coef = min(1.0, spec.clip_grad_norm / (grad_norm + 1e-6))
                for p in params:
                    if p.param.grad is not None:
                        p.param.grad.mul_(coef)
        _set_lr(s["opt"], lr)
        s["opt"].step()
        s["opt"].zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0

        total = global_loss(loss, sharded, ctx)
        drifts = replica_drift(step, params, ctx, set(case.replicated_hint))
        drift_by_name: dict[str, float] = {}
        for d in drifts:
            drift_by_name[d.name] = max(drift_by_name.get(d.name, 0.0), d.max_abs)
        # replicated params that did not drift are recorded as exact zeros
        for p in params:
            if p.replicated_tp and ctx.tp > 1:
                drift_by_name.setdefault(p.spec.ref_name, 0.0)
        param_err = torch.zeros((), dtype=torch.float64)
        for p in params:
            want = p.piece_of(s["ref_params"][p.spec.ref_name].detach(), ctx)
            got = p.full(p.param.detach())
            if want.numel():
                param_err = torch.maximum(param_err, (got.double() - want.double()).abs().max())
        dist.all_reduce(param_err, op=dist.ReduceOp.MAX)
        out.append({
            "step": step, "lr": lr, "tokens": tokens,
            "run": dict(loss=float(total), grad_norm=grad_norm, replica_drift=drift_by_name,
                        max_replica_drift=max(drift_by_name.values(), default=0.0), param_err_vs_ref=float(param_err),
                        step_time_s=step_time, tokens_per_s=tokens / step_time if step_time else float("nan")),
            "ref": dict(loss=float(ref_loss.detach()), grad_norm=float(ref_norm), replica_drift={}, max_replica_drift=0.0,
                        param_err_vs_ref=0.0, step_time_s=ref_time, tokens_per_s=tokens / ref_time if ref_time else float("nan")),
        })
        s["step"] += 1
    return out


def train_end(_: object = None) -> None:
    _STATE.clear()


# ---- driver side ---------------------------------------------------------------------------


@dataclass
class Progress:
    """A progress bar per run on a terminal; a line per quarter in logs (CI)."""

    run: str
    total: int
    stream: object = field(default_factory=lambda: sys.stderr)
    _last_quarter: int = -1

    def update(self, done: int, loss: float) -> None:
        tty = getattr(self.stream, "isatty", lambda: False)()
        if tty:
            filled = int(30 * done / self.total)
            self.stream.write(f"\r  {self.run:<4} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} steps  loss {loss:.4f}")
            if done == self.total:
                self.stream.write("\n")
        else:
            quarter = 4 * done // self.total
            if quarter != self._last_quarter:
                self._last_quarter = quarter
                self.stream.write(f"  {self.run:<4} {done}/{self.total} steps  loss {loss:.4f}\n")
        self.stream.flush()


def train(spec: TrainSpec, runner, *, chunk: int = 25, progress: bool = True,
          crashes: dict | None = None) -> tuple[list[StepRecord], list[StepRecord]]:
    """Run one lockstep training; returns (records of the run, records of its reference copy).

    A run that crashes or hangs stops there: its records so far are returned and, if `crashes`
    is given, crashes[run] = (step reached, the failure) -- the gate reports it as a FAIL."""
    from sp_harness.launch.failure import RankFailure

    cfg = spec.config
    label = f"converge {spec.run}: case {cfg.case} [{cfg.short()}]"
    bar = Progress(spec.run, spec.steps) if progress else None
    run_records: list[StepRecord] = []
    ref_records: list[StepRecord] = []
    done = 0
    try:
        runner.run(cfg.world_size, "sp_harness.suites.converge:train_start", spec, timeout_s=cfg.timeout_s, label=label)
        while done < spec.steps:
            n = min(chunk, spec.steps - done)
            rows = runner.run(cfg.world_size, "sp_harness.suites.converge:train_steps", n,
                              timeout_s=cfg.timeout_s + n * 5.0, label=label)[0]
            for row in rows:
                run_records.append(StepRecord(run=spec.run, step=row["step"], lr=row["lr"], **row["run"]))
                ref_records.append(StepRecord(run="ref", step=row["step"], lr=row["lr"], **row["ref"]))
            done += n
            if bar:
                bar.update(done, run_records[-1].loss)
    except RankFailure as exc:
        if crashes is None:
            raise
        crashes[spec.run] = (len(run_records), exc)
    finally:
        try:
            runner.run(cfg.world_size, "sp_harness.suites.converge:train_end", None, timeout_s=cfg.timeout_s, label=label)
        except Exception:
            pass
    return run_records, ref_records


@dataclass(kw_only=True, frozen=True)
class ConvergeOptions:
    case: str = "megatron-gpt-sp"
    """The case under test (SP)."""
    baseline: str | None = DEFAULT_BASELINE
    """The TP baseline case trained beside it; None: no baseline run."""
    world_size: int = 2
    """Ranks of the TP and SP runs."""
    dp: int = 1
    """Data-parallel degree of the TP and SP runs."""
    steps: int = 200
    """Optimizer steps."""
    seq_len: int = 32
    """Tokens per sequence."""
    batch: int = 8
    """Sequences per DP replica and step."""
    dtype: str = "float32"
    """Training dtype of every run (the gate's bands follow it)."""
    optimizer: str = "adamw"
    """'adamw' or 'sgd'."""
    lr: float = 1e-2
    """Peak learning rate."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    clip_grad_norm: float | None = 1.0
    """Global grad-norm clipping; None: off."""
    seed: int = 0
    """Initial weights."""
    data_seed: int = 1234
    """Markov chain and batch stream."""
    timeout_s: float = 120.0
    """Seconds per job (setup, or one chunk of steps) before it counts as hung."""


def converge(opts: ConvergeOptions, runner, out_dir: str | os.PathLike, *, golden: str | None = None,
             progress: bool = True):
    """Train reference, baseline and case in lockstep, write records, gate, write the report."""
    from sp_harness.judge.gate import evaluate
    from sp_harness.judge.golden import load_golden
    from sp_harness.record.records import make_meta, write_run_dir
    from sp_harness.report.html import write_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = CheckConfig(case=opts.case, world_size=opts.world_size, dp=opts.dp, seq_len=opts.seq_len, batch=opts.batch,
                       vocab=64, dtype=opts.dtype, optimizer=opts.optimizer, lr=opts.lr, seed=opts.seed,
                       timeout_s=opts.timeout_s)
    base = get_case(opts.case).resolve(base)
    get_case(opts.case).validate(base)
    common = dict(steps=opts.steps, warmup_steps=opts.warmup_steps, clip_grad_norm=opts.clip_grad_norm,
                  vocab=base.vocab, data_seed=opts.data_seed)
    runs: dict[str, list[StepRecord]] = {}
    crashes: dict = {}
    t0 = time.perf_counter()
    sp_records, ref_records = train(TrainSpec(run="sp", config=base, **common), runner, progress=progress,
                                    crashes=crashes)
    if "sp" in crashes:
        # the reference copy trained inside the crashed job: train it alone for a full curve
        _, ref_records = train(TrainSpec(run="ref", config=base.replace(case=DEFAULT_REFERENCE, world_size=opts.dp),
                                         **common), runner, progress=progress, crashes=crashes)
    runs["ref"] = ref_records
    if opts.baseline:
        runs["tp"], _ = train(TrainSpec(run="tp", config=base.replace(case=opts.baseline), **common), runner,
                              progress=progress, crashes=crashes)
    runs["sp"] = sp_records
    chain = MarkovChain.from_seed(vocab=base.vocab, seed=opts.data_seed, concentration=0.1)
    meta = make_meta(case=opts.case, config=_plain(base), world_size=opts.world_size, dp=opts.dp, tp=base.tp,
                     optimizer=opts.optimizer, dtype=opts.dtype, floor=chain.entropy_rate, runs=list(runs),
                     baseline=opts.baseline, steps=opts.steps, wall_s=time.perf_counter() - t0,
                     repro=f"sp-harness converge --case {opts.case} --world-size {opts.world_size} --dp {opts.dp} "
                           f"--steps {opts.steps} --dtype {opts.dtype}")
    golden_doc = load_golden(golden) if golden else None
    result = evaluate(runs, dtype=opts.dtype, golden=golden_doc)
    if crashes:
        result = _with_crashes(result, crashes)
    html = out / "report.html"
    if not dist.is_initialized() or dist.get_rank() == 0:  # under torchrun every rank gets here
        write_run_dir(out, runs, meta)
        html = write_report(out, runs, meta, result, golden=golden_doc)
    return result, html, runs


def _with_crashes(result, crashes: dict):
    import dataclasses

    from sp_harness.judge.gate import Failure

    extra = tuple(Failure(rule="crash", metric="step", run=run, step=step, value=float("nan"), band=0.0,
                          detail=f"{exc.describe(with_traces=False)}: {exc.summary_line()}")
                  for run, (step, exc) in sorted(crashes.items()))
    failures = tuple(sorted(extra + tuple(result.failures), key=lambda f: f.sort_key))
    return dataclasses.replace(result, verdict="FAIL", failures=failures)


def _plain(config: CheckConfig) -> dict:
    import dataclasses

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}


def format_gate(result, html) -> str:
    lines = [f"gate: {result.verdict}   report: {html}"]
    for reason in result.reasons[:10]:
        lines.append(f"  - {reason}")
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------------


def _add_converge_args(p: argparse.ArgumentParser) -> None:
    d = ConvergeOptions()
    p.add_argument("--case", default=d.case, help=f"case under test (default {d.case})")
    p.add_argument("--baseline", default=d.baseline, help=f"TP baseline case (default {d.baseline}); 'none' to skip")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--dp", type=int, default=d.dp)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", default=d.dtype, choices=["float64", "float32", "bfloat16"])
    p.add_argument("--optimizer", default=d.optimizer, choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data-seed", type=int, default=d.data_seed)
    p.add_argument("--timeout", type=float, default=d.timeout_s, dest="timeout_s")


def options_from_args(args) -> ConvergeOptions:
    for name in ("world_size", "dp", "steps", "seq_len", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size % args.dp:
        raise ValueError(f"dp({args.dp}) does not divide world_size({args.world_size})")
    get_case(args.case)
    baseline = None if args.baseline in (None, "none", "") else args.baseline
    if baseline:
        get_case(baseline)
    return ConvergeOptions(case=args.case, baseline=baseline, world_size=args.world_size, dp=args.dp, steps=args.steps,
                           seq_len=args.seq_len, batch=args.batch, dtype=args.dtype, optimizer=args.optimizer, lr=args.lr,
                           warmup_steps=args.warmup_steps, clip_grad_norm=args.clip_grad_norm or None, seed=args.seed,
                           data_seed=args.data_seed, timeout_s=args.timeout_s)


def cmd_converge(args) -> int:
    from sp_harness.launch.runner import is_leader as _is_leader
    from sp_harness.launch.runner import runner as _runner

    opts = options_from_args(args)
    runner = _runner()
    result, html, _ = converge(opts, runner, args.out, golden=args.golden, progress=_is_leader())
    if _is_leader():
        print(format_gate(result, html))
    return 0 if result.passed else 1


def cmd_gate(args) -> int:
    from sp_harness.judge.golden import load_golden
    from sp_harness.report.html import report_from_dir

    golden = load_golden(args.golden) if args.golden else None
    result, html = report_from_dir(args.dir, golden=golden)
    print(format_gate(result, html))
    return 0 if result.passed else 1


def cmd_golden(args) -> int:
    from sp_harness.judge.golden import make_golden, save_golden
    from sp_harness.launch.runner import runner as _runner

    opts = options_from_args(args)
    runner = _runner()
    repeats = []
    for i in range(args.repeats):
        _, _, runs = converge(opts, runner, Path(args.work_dir) / f"repeat{i}", progress=True)
        repeats.append(runs[args.run])
    doc = make_golden(repeats, meta={"case": opts.case, "run": args.run, "dtype": opts.dtype, "steps": opts.steps,
                                     "world_size": opts.world_size, "dp": opts.dp, "repeats": args.repeats})
    path = save_golden(args.out, doc)
    spread = max((max(m["spread"]) if m["spread"] else 0.0) for m in doc["metrics"].values())
    print(f"golden written to {path}: {args.repeats} repeat(s) of run '{args.run}', max spread {spread:.3g}")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("converge", help="lockstep convergence report: reference vs TP vs SP, gated")
    _add_converge_args(p)
    p.add_argument("--out", default="reports/latest", help="report directory (default reports/latest)")
    p.add_argument("--golden", help="golden curve JSON to gate against")
    p.set_defaults(func=cmd_converge)
    p = sub.add_parser("gate", help="re-gate a report directory (optionally against a golden curve)")
    p.add_argument("dir")
    p.add_argument("--golden")
    p.set_defaults(func=cmd_gate)
    p = sub.add_parser("golden", help="make a golden curve file from N repeated runs")
    _add_converge_args(p)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--run", default="sp", help="which run's curve to store (default sp)")
    p.add_argument("--out", required=True, help="golden JSON path, e.g. reports/golden/megatron-gpt-sp.json")
    p.add_argument("--work-dir", default="reports/golden-work")
    p.set_defaults(func=cmd_golden)


def main(argv: list[str] | None = None) -> int:
    """`torchrun --nproc-per-node N -m sp_harness.suites.converge [converge options] --out DIR`."""
    parser = argparse.ArgumentParser(prog="python -m sp_harness.suites.converge")
    _add_converge_args(parser)
    parser.add_argument("--out", default="reports/latest")
    parser.add_argument("--golden")
    args = parser.parse_args(argv)
    return cmd_converge(args)


if __name__ == "__main__":
    sys.exit(main())
