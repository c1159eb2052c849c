"""Stage: top. The `sp-harness` command line.

Exit codes (EXIT_*): 0 all agreed (or were declared UNSUPPORTED), 1 a disagreement (FAIL: a
defect of the code under test), 2 bad usage (one line, before any rank starts), 3 a check that
could not run (ERROR: a crash before the code under test's first step). A FAIL outranks an ERROR.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from sp_harness.config.check_config import ENGINE_DEFAULTS, CheckConfig
from sp_harness.config.flags import add_flags, from_args
from sp_harness.launch.runner import WithProgress, check_world_size
from sp_harness.launch.runner import is_leader as _is_leader
from sp_harness.launch.runner import runner as _runner

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits 2 already; keep its message, add the hint
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_config_args(p: argparse.ArgumentParser) -> None:
    """`check`'s config flags, one per CheckConfig field (generated from its declarations)."""
    add_flags(p.add_argument_group("config"), CheckConfig, fallbacks=ENGINE_DEFAULTS)


def config_from_args(args) -> CheckConfig:
    return from_args(CheckConfig, args)


def cmd_list(args) -> int:
    from sp_harness.config.registry import all_cases, unavailable_cases

    # a case that cannot run here is listed, its description saying why ("unavailable: needs ...")
    cases = {**all_cases(), **unavailable_cases()}
    width = max(len(n) for n in cases)
    for name, case in sorted(cases.items(), key=lambda kv: ("mutant" in kv[1].tags, kv[0])):
        kind = "mutant" if "mutant" in case.tags else "case"
        print(f"{name:<{width}}  {kind:<6}  {case.models_bug or case.description}")
    return EXIT_OK


def _check_names(args) -> list[str]:
    names = ["train-step" if args.train_step else "side-by-side"]
    if args.compare_comm:
        names.append("comm-vs-baseline")
    if args.memory:
        names.append("activation-memory")
    names += [n for n in args.also if n not in names]
    return names


def cmd_check(args) -> int:
    from sp_harness.checks import Outcome, get_check, run_check
    from sp_harness.config.registry import get_case
    from sp_harness.report.text import check_writable, dump_json, format_outcomes

    config = config_from_args(args)
    if args.json:
        check_writable(args.json)
    case = get_case(config.case)  # unknown case: ValueError -> exit 2 before any rank starts
    checks = [get_check(name) for name in _check_names(args)]  # unknown check: exit 2 as well
    if config.train_step:
        from sp_harness.checks.train_step import require_train_step
        from sp_harness.config.case import Unsupported

        # no declared step, or no valid token: one line and exit 2 before any rank starts
        try:
            require_train_step(case, case.resolve(config))
        except Unsupported:
            pass  # the check reports it as its verdict
    check_world_size(config.world_size)
    runner = _runner()
    if sys.stderr.isatty() or os.environ.get("SP_HARNESS_PROGRESS"):  # pytest and pipes stay quiet
        runner = WithProgress(runner, lambda line: print(f"sp-harness: {line}", file=sys.stderr, flush=True))
    outcomes = [run_check(checks[0], config, runner)]
    first = outcomes[0]
    for c in checks[1:]:
        # the other checks build on a passing first check (after a crash they would only repeat
        # it, after a FAIL they would judge a known-wrong model): named as skipped, with why
        if not first.passed:
            verdict = getattr(first.figures, "verdict", first.status.upper())  # UNSUPPORTED, not 'N/A'
            outcomes.append(Outcome(check=c.name, status="n/a", skipped=True,
                                    detail=f"the {first.check} check did not pass ({verdict})"))
        elif (not_for := c.applies(case, config)) is not None:
            outcomes.append(Outcome(check=c.name, status="n/a", detail=not_for))
        else:
            outcomes.append(run_check(c, config, runner))
    if _is_leader():
        print(format_outcomes(outcomes, verbose=args.verbose))
        if args.json:
            dump_json(outcomes, args.json)
    return exit_code(outcomes)


def exit_code(outcomes) -> int:
    """A FAIL outranks an ERROR: a defect found is news even where another check could not run."""
    if any(o.passed is False for o in outcomes):
        return EXIT_FAIL
    if any(o.status == "error" for o in outcomes):
        return EXIT_ERROR
    return EXIT_OK


_EXAMPLES = """examples:
  sp-harness list                                               the cases and mutants
  sp-harness env                                                frameworks installed, their releases, in range?
  sp-harness check --case megatron-gpt-sp --world-size 3 --seq-len 10
  sp-harness check --case path/to/my_case.py:MY_CASE --world-size 2 --json verdict.json
  sp-harness converge --case megatron-gpt-sp --steps 200 --out reports/latest
  sp-harness nightly                                            the main job
  sp-harness mutants                                            the mutant catalogue

exit codes: 0 as expected (PASS or UNSUPPORTED), 1 a FAIL verdict, 2 a usage error (one line,
nothing run), 3 an ERROR verdict (a crash before the code under test's first step)"""


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
    # extend: `--also a --also b` and `--also a b` both run a and b
    p.add_argument("--also", nargs="+", action="extend", default=[], metavar="CHECK",
                   help="more checks to run after a PASS, repeatable or space-separated "
                        "(e.g. --also lockstep accumulation-invariance); a check after a non-PASS is skipped, named")
    p.set_defaults(func=cmd_check)
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands():
    """Subcommands living in their own modules (converge, gate, golden, nightly, mutants, bench,
    sensitivity, releases)."""
    import importlib

    suites = ("converge", "nightly", "battery", "bench", "sensitivity", "releases")
    return [importlib.import_module(f"sp_harness.suites.{name}").add_subcommands for name in suites]


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a CI runner cancelling the job): cleaned up exactly like Ctrl-C."""


def _on_signal(signum, frame):
    from sp_harness.launch.replies import interrupt_pending

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
        from sp_harness.launch.replies import interrupt_pending

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
