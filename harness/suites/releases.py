"""Stage: suites. The release cases on the releases installed here: each real training-step bug a
framework shipped (a correct case tagged 'release', whose expected verdict follows the installed
release) is checked at its config; it must FAIL at its pinned stage where the release has the
bug, and PASS where it is fixed.

`sp-harness releases --out FILE` appends one JSON record per check (full precision, never parsed
from printed text), with the installed releases; the release matrix (`tox -m releases`) runs it
in one environment per framework release. `sp-harness releases --table FILE...` renders those
records as the release x verdict table of docs/frameworks/README.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def release_configs(only: str | None = None) -> list:
    """(config, case) for every release case that can run here (`all_cases()`: its framework
    installed and in range), `only` those whose name contains it."""
    from sp_harness.config.registry import all_cases

    return [(ex.config(name), case) for name, case in sorted(all_cases().items())
            if "release" in case.tags and (only is None or only in name) for ex in case.examples]


def installed_releases() -> dict[str, str]:
    """distribution -> release, for every framework integration's distributions installed here."""
    import importlib

    # read by name, as the registry reads sp_harness.cases: the engine names no case module
    installed_release = importlib.import_module("sp_harness.cases.frameworks.releases").installed_release
    frameworks = importlib.import_module("sp_harness.cases.frameworks")
    found = {}
    for compat_module in frameworks.COMPAT.values():
        for r in importlib.import_module(compat_module).RELEASES:
            release = installed_release(r.distribution)
            if release is not None:
                found[r.distribution] = release
    return found


def run_release_cases(out: Path | None, only: str | None = None) -> int:
    from sp_harness.checks import side_by_side, train_step
    from sp_harness.judge.expect import expected_verdict
    from sp_harness.launch.runner import runner as _runner

    runner = _runner()
    releases = installed_releases()
    configs = release_configs(only)
    print(f"release cases: {len(configs)} on {', '.join(f'{d} {v}' for d, v in sorted(releases.items()))}")
    bad = 0
    for config, case in configs:
        expected = expected_verdict(config)
        # the check's own Outcome: its caught_by is the stage a mutant's killed_by pins
        outcome = (train_step.CHECK if config.train_step else side_by_side.CHECK).run(config, runner)
        res = outcome.figures
        caught = outcome.caught_by if res.verdict == "FAIL" else ""
        pinned = case.killed_by[0] if case.killed_by else ""
        ok = res.verdict == expected and (res.verdict != "FAIL" or caught == pinned)
        bad += not ok
        own = _distributions(config.case)
        record = {"case": config.case, "config": res.config.short(),
                  "releases": {d: v for d, v in releases.items() if d in own}, "expected": expected,
                  "verdict": res.verdict, "caught_by": caught, "pinned": pinned, "ok": ok, "bug": case.models_bug,
                  "source": case.source, "reason": res.reason.splitlines()[0] if res.reason else "",
                  "repro": res.config.repro(), "env": os.environ.get("TOX_ENV_NAME", "")}
        print(f"  {'ok ' if ok else 'UNEXPECTED'} {res.verdict:<11} (expected {expected}{f' at {pinned}' if expected == 'FAIL' else ''})"
              f" {config.case}  {res.config.short()}" + (f"  caught by {caught}" if caught else ""))
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    return 1 if bad else 0


def table(paths: list[Path]) -> str:
    """The release x verdict table of the records in `paths`: one row per case and installed
    release set (the latest record where several ran the same), then each case's bug and source."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    latest = {(r["case"], tuple(sorted(r["releases"].items()))): r for r in rows}
    lines = ["| release case | installed | expected | verdict | caught by | as expected |", "|---|---|---|---|---|---|"]
    for (case, releases), r in sorted(latest.items(), key=lambda kv: (kv[0][0], [_release_sort(v) for _, v in kv[0][1]])):
        installed = ", ".join(f"{d} {v}" for d, v in releases)
        lines.append(f"| `{case}` | {installed or '-'} | {r['expected']} | {r['verdict']} | {r['caught_by'] or '-'} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    bugs = {r["case"]: r for r in rows}
    lines += ["", "| release case | the bug | source |", "|---|---|---|"]
    lines += [f"| `{case}` | {r['bug']} | {r['source']} |" for case, r in sorted(bugs.items())]
    return "\n".join(lines)


def _release_sort(release: str) -> tuple[int, ...]:
    """The one ordering of releases (sp_harness.cases.frameworks.releases.release_key, read by name:
    the engine names no case module)."""
    import importlib

    return importlib.import_module("sp_harness.cases.frameworks.releases").release_key(release)


def _distributions(case_name: str) -> tuple[str, ...]:
    """The distributions a release case's framework runs on (its records carry only those)."""
    import importlib

    frameworks = importlib.import_module("sp_harness.cases.frameworks")
    for framework, (_, names) in frameworks.FRAMEWORK_CASES.items():
        if case_name in names:
            return tuple(r.distribution for r in importlib.import_module(frameworks.COMPAT[framework]).RELEASES)
    return ()


def cmd_env(args) -> int:
    """Prints each framework integration's installed releases against its supported range: one
    line per distribution, the framework's status on its first."""
    import importlib

    installed_frameworks = importlib.import_module("sp_harness.cases.frameworks").installed_frameworks
    print(f"{'integration':<14} {'distribution':<14} {'installed':<10} {'supported':<18} status")
    for row in installed_frameworks(probe_apis=args.probe):
        for i, (distribution, release, supported) in enumerate(row.releases):
            print(f"{row.package if i == 0 else '':<14} {distribution:<14} {release or '-':<10} {supported:<18} "
                  f"{row.verdict if i == 0 else ''}".rstrip())
    return 0


def cmd_releases(args) -> int:
    if args.table:
        missing = [p for p in args.table if not Path(p).is_file()]
        if missing:
            raise ValueError(f"--table: no such record file {missing[0]} (sp-harness releases --out FILE writes one)")
        print(table([Path(p) for p in args.table]))
        return 0
    if args.out is not None and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a file to append JSON records to")
    rc = run_release_cases(Path(args.out) if args.out else None, args.only)
    sys.stdout.flush()
    return rc


def add_subcommands(sub) -> None:
    p = sub.add_parser("env", help="the frameworks installed, their releases, and whether each is in the supported range")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="read releases only (no framework import): skip asking each for the APIs its integration needs")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("releases", help="check the release cases (real bugs frameworks shipped) on the installed releases")
    p.add_argument("--out", metavar="FILE", help="append one JSON record per check to FILE")
    p.add_argument("--only", metavar="TEXT", help="only the release cases whose name contains TEXT")
    p.add_argument("--table", nargs="+", metavar="FILE", help="render records (from --out) as the release x verdict table")
    p.set_defaults(func=cmd_releases)
