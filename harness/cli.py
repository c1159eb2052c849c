"""Stage: top. The `sp-harness` command line.

Exit codes: 0 all agreed (or were declared UNSUPPORTED), 1 a disagreement (FAIL), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from sp_harness.config.check_config import (
    ADVERSARIES,
    DEFAULT_STEPS,
    DTYPES,
    ENGINE_DEFAULTS,
    LAYOUTS,
    LOAD_BALANCERS,
    NORMS,
    OPTIMIZERS,
    CheckConfig,
)
from sp_harness.launch.runner import WithProgress, check_world_size
from sp_harness.launch.runner import is_leader as _is_leader
from sp_harness.launch.runner import runner as _runner

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 already; keep its message, add the hint
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _shards(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 4,4,2, got {text!r}") from None
    if any(n < 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"token counts must be >= 0, got {text!r}")
    return sizes


def add_config_args(p: argparse.ArgumentParser, *, require_case: bool = True) -> None:
    g = p.add_argument_group("config")
    g.add_argument("--case", required=require_case, help="case name (see `sp-harness list`) or path/to/file.py:NAME")
    g.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    g.add_argument("--dp", type=_positive_int, default=1, help="data-parallel degree; tp = world-size / dp (default 1)")
    g.add_argument("--seq-len", type=_positive_int, help="global sequence length (default: the case's)")
    g.add_argument("--seq-shards", type=_shards, help="explicit tokens per TP rank, e.g. 4,4,2 (default: torch.chunk's)")
    g.add_argument("--batch", type=_positive_int, help=f"sequences per DP replica (default: the case's, else {ENGINE_DEFAULTS['batch']})")
    g.add_argument("--hidden", type=_positive_int, help="model width (default: the case's)")
    g.add_argument("--ffn", type=_positive_int, help="MLP inner width (default: the case's)")
    g.add_argument("--num-heads", type=_positive_int, help="attention heads (default: the case's)")
    g.add_argument("--num-kv-heads", type=_positive_int,
                   help="key/value heads, grouped-query attention (default: the case's, else num-heads)")
    g.add_argument("--causal", choices=("yes", "no"), help="causal attention (default: the case's, else yes)")
    g.add_argument("--load-balancer", choices=LOAD_BALANCERS,
                   help="context-parallel chunk placement (default: the case's, else none)")
    g.add_argument("--ring-degree", type=_positive_int,
                   help="ranks per ring in a Ulysses x ring case (default: the case's, else 1)")
    g.add_argument("--prompt-len", type=int,
                   help="leading tokens per sequence whose targets carry no loss, < seq-len (default: the case's, else 0)")
    g.add_argument("--num-layers", type=_positive_int, help="transformer blocks (default: the case's)")
    g.add_argument("--vocab", type=_positive_int, help="vocabulary size (default: the case's)")
    g.add_argument("--norm", choices=NORMS, help=f"norm of cases that have one (default: the case's, else {ENGINE_DEFAULTS['norm']})")
    g.add_argument("--layout", choices=LAYOUTS,
                   help=f"activation layout, [b, s, h] or [s, b, h] (default: the case's, else {ENGINE_DEFAULTS['layout']})")
    g.add_argument("--dtype", choices=sorted(DTYPES),
                   help=f"dtype of the sharded run; the judge is float64 (default: the case's, else {ENGINE_DEFAULTS['dtype']})")
    g.add_argument("--steps", type=_positive_int,
                   help=f"optimizer steps to run and compare (default: the case's, else {DEFAULT_STEPS})")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights and the data (default 0)")
    g.add_argument("--lr", type=float, help=f"learning rate (default: the case's, else {ENGINE_DEFAULTS['lr']})")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=f"optimizer (default: the case's, else {ENGINE_DEFAULTS['optimizer']})")
    g.add_argument("--adversary", choices=ADVERSARIES, default="off",
                   help="make the sharded side reduce in random legal orders (specificity across platforms; default off)")
    g.add_argument("--forward-only", choices=("yes", "no"),
                   help="inference: forward and loss only, no backward or optimizer step; grads are not judged "
                        "(default: the case's, else no)")
    g.add_argument("--timeout", type=float, dest="timeout_s",
                   help="seconds a job may run before it counts as hung (default $SP_HARNESS_TIMEOUT, else 30)")


def config_from_args(args) -> CheckConfig:
    return CheckConfig(
        case=args.case, world_size=args.world_size, dp=args.dp, seq_len=args.seq_len, seq_shards=args.seq_shards,
        batch=args.batch, hidden=args.hidden, ffn=args.ffn, num_heads=args.num_heads, num_layers=args.num_layers,
        vocab=args.vocab, num_kv_heads=args.num_kv_heads,
        causal=None if args.causal is None else args.causal == "yes", load_balancer=args.load_balancer,
        ring_degree=args.ring_degree, prompt_len=args.prompt_len, norm=args.norm, layout=args.layout, dtype=args.dtype, steps=args.steps, seed=args.seed,
        lr=args.lr, optimizer=args.optimizer, adversary=args.adversary, timeout_s=args.timeout_s,
        forward_only=None if args.forward_only is None else args.forward_only == "yes",
    )


def cmd_list(args) -> int:
    from sp_harness.config.case import all_cases

    cases = all_cases()
    width = max(len(n) for n in cases)
    for name, case in sorted(cases.items(), key=lambda kv: ("mutant" in kv[1].tags, kv[0])):
        kind = "mutant" if "mutant" in case.tags else "case"
        print(f"{name:<{width}}  {kind:<6}  {case.models_bug or case.description}")
    return EXIT_OK


def _check_names(args) -> list[str]:
    names = ["side-by-side"]
    if args.compare_comm:
        names.append("comm-vs-baseline")
    if args.memory:
        names.append("activation-memory")
    names += [n for n in args.also if n not in names]
    return names


def cmd_check(args) -> int:
    from sp_harness.checks import get_check, run_check
    from sp_harness.config.case import get_case
    from sp_harness.report.text import check_writable, dump_json, format_outcomes

    config = config_from_args(args)
    if args.json:
        check_writable(args.json)
    case = get_case(config.case)  # unknown case: ValueError -> exit 2 before any rank starts
    checks = [get_check(name) for name in _check_names(args)]  # unknown check: exit 2 as well
    check_world_size(config.world_size)
    runner = _runner()
    if sys.stderr.isatty() or os.environ.get("SP_HARNESS_PROGRESS"):  # pytest and pipes stay quiet
        runner = WithProgress(runner, lambda line: print(f"sp-harness: {line}", file=sys.stderr, flush=True))
    outcomes = [run_check(checks[0], config, runner)]
    if outcomes[0].passed:
        # the other checks build on a passing side-by-side run (a crash would only repeat)
        outcomes += [run_check(c, config, runner) for c in checks[1:] if c.applies(case, config) is None]
    if _is_leader():
        print(format_outcomes(outcomes, verbose=args.verbose))
        if args.json:
            dump_json(outcomes, args.json)
    return EXIT_FAIL if any(o.passed is False for o in outcomes) else EXIT_OK


_EXAMPLES = """examples:
  sp-harness list                                               the cases and mutants
  sp-harness check --case megatron-gpt-sp --world-size 3 --seq-len 10
  sp-harness check --case path/to/my_case.py:MY_CASE --world-size 2 --json verdict.json
  sp-harness converge --case megatron-gpt-sp --steps 200 --out reports/latest
  sp-harness nightly                                            the main job
  sp-harness mutants                                            the mutant catalogue

exit codes: 0 as expected, 1 a FAIL verdict, 2 a usage or setup error (one line, nothing run)"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sp-harness", description="Verify sequence-parallel implementations against a single-device reference.",
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLES)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("list", help="list the cases and mutants")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("check", help="run one side-by-side check", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  sp-harness check --case megatron-gpt-sp --world-size 3 --seq-shards 4,4,2\n"
                              "  sp-harness check --case seed-mlp --dtype float32 --adversary reorder --memory\n"
                              "  sp-harness check --case my_case.py:MY_CASE --world-size 4 --dp 2 --also lockstep")
    add_config_args(p)
    p.add_argument("--json", metavar="FILE", help="write the verdict as JSON")
    p.add_argument("--verbose", "-v", action="store_true", help="every failure and full tracebacks")
    p.add_argument("--memory", action="store_true",
                   help="also measure one layer's saved activations vs TP and the paper's formula, and gate on it")
    p.add_argument("--no-compare-comm", dest="compare_comm", action="store_false",
                   help="skip the TP-baseline run that checks communication volume against the paper")
    p.add_argument("--also", nargs="*", default=[], metavar="CHECK",
                   help="more checks to run after a PASS (e.g. lockstep; see sp_harness.checks)")
    p.set_defaults(func=cmd_check)
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands():
    """Subcommands living in their own modules (converge, gate, golden, mutants, bench)."""
    import importlib

    out = []
    for mod in ("sp_harness.suites.converge", "sp_harness.suites.nightly", "sp_harness.suites.battery", "sp_harness.suites.bench", "sp_harness.suites.sensitivity"):
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name == mod:
                continue
            raise
        out.append(module.add_subcommands)
    return out


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a CI runner cancelling the job): cleaned up exactly like Ctrl-C."""


def _on_signal(signum, frame):
    from sp_harness.launch.pool import interrupt_pending

    exc = _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    interrupt_pending(exc)  # raised again by the rank wait loop, should this one be swallowed
    raise exc


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from sp_harness.launch.torchrun import finish, under_torchrun

    if under_torchrun():
        # torchrun's SIGTERM must end a rank even while it is blocked in a collective, where no
        # Python handler would run; there is no pool to clean up
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        finish(_run(args))
    signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, _on_signal)
    return _run(args)


def _run(args) -> int:
    try:
        return args.func(args)
    except ValueError as exc:  # user errors: the message names the value and what is valid
        print(f"sp-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        from sp_harness.launch.runner import default_manager

        # a second Ctrl-C must not cut the cleanup short (and print its traceback)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from sp_harness.launch.pool import interrupt_pending

        interrupt_pending(None)
        default_manager().close()
        print("sp-harness: interrupted; ranks stopped", file=sys.stderr)
        return 143 if isinstance(exc, _Terminated) else 130
    except BrokenPipeError:
        # `sp-harness list | head`: the reader left; say nothing more, as cat and ls do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
