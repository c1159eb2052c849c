"""Stage: config -> ... -> report. The `sp-harness` command line.

Exit codes: 0 all agreed (or were declared UNSUPPORTED), 1 a disagreement (FAIL), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys

from sp_harness.config.check_config import ADVERSARIES, DEFAULT_STEPS, DTYPES, LAYOUTS, NORMS, OPTIMIZERS, CheckConfig

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
    g.add_argument("--dp", type=_positive_int, default=1, help="data-parallel degree; tp = world-size / dp")
    g.add_argument("--seq-len", type=_positive_int, help="global sequence length")
    g.add_argument("--seq-shards", type=_shards, help="explicit tokens per TP rank, e.g. 4,4,2")
    g.add_argument("--batch", type=_positive_int, default=2, help="sequences per DP replica")
    g.add_argument("--hidden", type=_positive_int)
    g.add_argument("--ffn", type=_positive_int)
    g.add_argument("--num-heads", type=_positive_int)
    g.add_argument("--num-layers", type=_positive_int)
    g.add_argument("--vocab", type=_positive_int)
    g.add_argument("--norm", choices=NORMS, default="layernorm")
    g.add_argument("--layout", choices=LAYOUTS, default="bsh")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    g.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                   help=f"optimizer steps to run and compare (default {DEFAULT_STEPS})")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    g.add_argument("--adversary", choices=ADVERSARIES, default="off",
                   help="make the sharded side reduce in random legal orders (specificity across platforms)")
    g.add_argument("--timeout", type=float, default=30.0, dest="timeout_s", help="seconds per job before it counts as hung")


def config_from_args(args) -> CheckConfig:
    return CheckConfig(
        case=args.case, world_size=args.world_size, dp=args.dp, seq_len=args.seq_len, seq_shards=args.seq_shards,
        batch=args.batch, hidden=args.hidden, ffn=args.ffn, num_heads=args.num_heads, num_layers=args.num_layers,
        vocab=args.vocab, norm=args.norm, layout=args.layout, dtype=args.dtype, steps=args.steps, seed=args.seed,
        lr=args.lr, optimizer=args.optimizer, adversary=args.adversary, timeout_s=args.timeout_s,
    )


def _runner():
    from sp_harness.checks.verify import default_manager
    from sp_harness.launch.torchrun import TorchrunWorld, under_torchrun

    return TorchrunWorld() if under_torchrun() else default_manager()


def _is_leader() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def cmd_list(args) -> int:
    from sp_harness.config.case import all_cases

    cases = all_cases()
    width = max(len(n) for n in cases)
    for name, case in sorted(cases.items(), key=lambda kv: ("mutant" in kv[1].tags, kv[0])):
        kind = "mutant" if "mutant" in case.tags else "case"
        print(f"{name:<{width}}  {kind:<6}  {case.models_bug or case.description}")
    return EXIT_OK


def cmd_check(args) -> int:
    from sp_harness.checks.verify import FAIL, check, dump_json, format_comm, format_result

    config = config_from_args(args)
    from sp_harness.config.case import get_case

    get_case(config.case)  # unknown case: ValueError -> exit 2 before any rank starts
    runner = _runner()
    result = check(config, runner)
    results = [result]
    baseline = None
    if args.compare_comm and result.verdict != FAIL:
        baseline = _comm_baseline(result, runner)
    memory_ok, memory_text = None, ""
    if args.memory and result.verdict == "PASS":
        from sp_harness.checks.memory import memory_gate

        memory_ok, memory_text = memory_gate(result.config, runner)
    if _is_leader():
        print(format_result(result, verbose=args.verbose))
        if result.comm or result.verdict == "PASS":
            print(format_comm(result.comm))
        if baseline is not None:
            print(baseline)
        if memory_text:
            print(memory_text)
        if args.json:
            dump_json(results, args.json)
    return EXIT_FAIL if result.verdict == FAIL or memory_ok is False else EXIT_OK


def _comm_baseline(result, runner) -> str | None:
    """For a case with a TP twin (name ending in -sp): the paper's communication accounting."""
    from sp_harness.capture.comm import paper_check
    from sp_harness.checks.verify import check
    from sp_harness.config.case import all_cases

    name = result.config.case
    if not name.endswith("-sp") or name[:-3] + "-tp" not in all_cases():
        return None
    twin = check(result.config.replace(case=name[:-3] + "-tp"), runner)
    if not twin.comm:
        return f"communication vs TP: TP twin gave {twin.verdict}, no figures"
    fig = paper_check(twin.comm, result.comm, tp=result.config.tp)
    ar, ag, rs = fig["tp_all_reduce"], fig["sp_all_gather"], fig["sp_reduce_scatter"]
    return "\n".join([
        "communication per step vs the paper (Korthikanti et al. 2022, sec. 4.2.2), tp group, forward+backward:",
        f"  TP   : {ar['count']} all-reduce, payload {ar['bytes']} B, ring bytes/rank {fig['tp_ring_bytes']:.0f}",
        f"  TP+SP: {ag['count']} all-gather + {rs['count']} reduce-scatter, payload {ag['bytes']} + {rs['bytes']} B, "
        f"ring bytes/rank {fig['sp_ring_bytes']:.0f}",
        f"  each all-reduce replaced by reduce-scatter + all-gather of the same payload: "
        f"{'yes' if fig['matches'] else 'NO'}" + (f" (SP also uses {fig['sp_other_kinds']})" if fig["sp_other_kinds"] else "")
        + _padding_note(result.config, fig),
    ])


def _padding_note(config, fig) -> str:
    from sp_harness.config.shards import chunk_sizes, is_even

    if fig["matches"] or not fig["tp_ring_bytes"]:
        return ""
    sizes = config.seq_shards or chunk_sizes(config.seq_len, config.tp)
    ratio = fig["sp_ring_bytes"] / fig["tp_ring_bytes"]
    why = (f": uneven shards {'/'.join(map(str, sizes))} are padded to {max(sizes)} tokens per rank "
           f"({config.tp} x {max(sizes)} = {config.tp * max(sizes)} vs {sum(sizes)})") if not is_even(sizes) else ""
    return f"; SP moves {ratio:.3f}x the TP volume{why}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sp-harness", description="Verify sequence-parallel implementations against a single-device reference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("list", help="list the cases and mutants")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("check", help="run one side-by-side check")
    add_config_args(p)
    p.add_argument("--json", metavar="FILE", help="write the verdict as JSON")
    p.add_argument("--verbose", "-v", action="store_true", help="every failure and full tracebacks")
    p.add_argument("--memory", action="store_true",
                   help="also measure one layer's saved activations vs TP and the paper's formula, and gate on it")
    p.add_argument("--no-compare-comm", dest="compare_comm", action="store_false",
                   help="skip the TP-twin run that checks communication volume against the paper")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # user errors: the message names the value and what is valid
        print(f"sp-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        from sp_harness.checks.verify import default_manager

        default_manager().close()
        print("sp-harness: interrupted; ranks stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `sp-harness list | head`: the reader left; say nothing more, as cat and ls do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
