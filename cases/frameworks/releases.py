"""Stage: step. The releases each framework integration supports, and the two questions asked of
the installed one before any rank starts.

Each framework package holds its release differences in one module, `compat` (docs/frameworks/
README.md): `RELEASES`, the supported range of each distribution it runs on, and `missing()`,
the APIs the integration needs that the installed release lacks, found by asking for them
(`hasattr`, `inspect.signature`), never by comparing version strings. Everything else in the
package asks `compat` for a capability.

1. In range? `outside()` reads the installed release from the distribution's metadata
   (importlib.metadata: no import of the framework), so `sp-harness list` and the registry's
   `unavailable()` can answer it for every framework at no cost.
2. The APIs there? `missing()` imports the framework. The driver asks it in a child interpreter
   (`probe`), once per framework per process, so that no framework is imported into the driver
   (whose memory and threads the rank processes' fork server must not inherit) and a release
   whose import crashes is a reason, not a crash. Where `PROBE_CACHE_ENV` names a folder, the
   processes of one run (a test session's workers and the CLIs its tests start) share answers.

Either answer is the case's `Unsupported` (`require`), raised from the case's `validate`: before
any rank starts, naming the API or the release and the range, exit 0, never FAIL.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sp_harness.config.case import Case, Example, Unsupported
from sp_harness.config.registry import register

PROBE_TIMEOUT_S = 600
"""A cold import of DeepSpeed or megatron-core on a loaded 2-core machine has taken over a minute;
the probe is one import, so ten minutes means the install is broken, not slow."""

PROBE_CACHE_ENV = "SP_HARNESS_PROBE_CACHE"
"""A folder where `probe` keeps its answers for other processes (this project's test session sets
one for its run and removes it after): each answer costs an import of the framework in a child
(2-12 s), and a run's processes ask the same questions of the same install (the suite's two
workers asked 8 of its 17 twice). An answer is keyed by the interpreter, the question and the
child's import path, so a test's fake on that path is asked afresh; a timeout is not kept.
Unset, as for users: once per process."""


@dataclass(kw_only=True, frozen=True)
class ReleaseRange:
    """The releases of one distribution an integration supports, both ends included."""

    distribution: str
    """Its name on PyPI (importlib.metadata's), e.g. 'transformers'."""
    oldest: str
    """The oldest release supported, e.g. '4.45.0'."""
    newest: str
    """The newest release supported, e.g. '5.23.0'."""
    note: str = ""
    """What a user must know to get a release of the range (megatron-core 0.19: Python 3.12)."""

    def __post_init__(self) -> None:
        if release_key(self.oldest) > release_key(self.newest):
            raise ValueError(f"{self.distribution}: oldest {self.oldest} is newer than newest {self.newest}")

    def describe(self) -> str:
        return f"{self.distribution} {self.oldest} to {self.newest}" + (f" ({self.note})" if self.note else "")


def release_key(release: str) -> tuple[int, ...]:
    """'0.19.0rc1' -> (0, 19, 0): the numeric release, as the ranges are written (final releases;
    a pre-release counts as its final)."""
    match = re.match(r"\d+(\.\d+)*", release)
    if match is None:
        raise ValueError(f"release {release!r} does not start with a numeric version like 4.45.0")
    return tuple(int(part) for part in match.group(0).split("."))


def installed_release(distribution: str) -> str | None:
    """The installed release of `distribution`, from its metadata; None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def outside(ranges: tuple[ReleaseRange, ...]) -> str | None:
    """None where every installed distribution of `ranges` is in its range (one not installed is
    the import question's, not this one's); else why, worded to follow "needs ": the first one
    out of range."""
    for r in ranges:
        release = installed_release(r.distribution)
        if release is None:
            continue
        key = release_key(release)
        if not release_key(r.oldest) <= key[:len(release_key(r.newest))] <= release_key(r.newest):
            return f"{r.describe()} (the supported range), and {r.distribution} {release} is installed"
    return None


@functools.cache
def probe(compat_module: str, function: str = "missing") -> tuple[str, ...]:
    """`compat_module.missing()` (or another of its functions that names the gaps of a capability,
    say the HF Trainer's `sp_missing`), asked in a child interpreter (see the module docstring); a
    child that fails answers why, as one missing item."""
    # the child sees what this process sees (a user's case folder, a test's fakes), before its own
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*sys.path, os.environ.get("PYTHONPATH")]))}
    kept = _kept_answer(compat_module, function, env["PYTHONPATH"])
    if kept is not None:
        try:
            return tuple(json.loads(kept.read_text()))
        except (OSError, ValueError):  # not asked yet in this run (or its folder is gone): ask the child
            pass
    try:
        # its own temporary folder, removed after: importing a framework makes torch's inductor cache
        # folder (torch._inductor.config: TMPDIR/torchinductor_USER), which must not stay in /tmp
        with tempfile.TemporaryDirectory(prefix="sp-harness-probe-") as scratch:
            done = subprocess.run([sys.executable, "-m", __name__, compat_module, function], capture_output=True,
                                  text=True, timeout=PROBE_TIMEOUT_S, check=False, env={**env, "TMPDIR": scratch})
    except subprocess.TimeoutExpired:
        return (f"an import of the framework that finishes ({compat_module}'s probe ran past {PROBE_TIMEOUT_S} s)",)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        answer: tuple[str, ...] = (f"an import of the framework that works (it raised here: {tail})",)
    else:
        answer = tuple(json.loads(done.stdout.strip().splitlines()[-1]))
    if kept is not None:
        try:  # written whole, then renamed: a reader sees the answer or nothing
            scratch_file = kept.with_suffix(f".{os.getpid()}.tmp")
            scratch_file.write_text(json.dumps(answer))
            os.replace(scratch_file, kept)
        except OSError:  # the folder went away (its session ended): only the sharing is lost
            pass
    return answer


def _kept_answer(compat_module: str, function: str, child_path: str) -> pathlib.Path | None:
    """Where `PROBE_CACHE_ENV`'s folder keeps this question's answer; None where no folder is set."""
    folder = os.environ.get(PROBE_CACHE_ENV)
    if not folder:
        return None
    key = hashlib.sha256(json.dumps([sys.executable, compat_module, function, child_path]).encode()).hexdigest()
    return pathlib.Path(folder) / f"{key[:32]}.json"


def api_gaps(apis: Sequence[tuple[str, str, tuple[str, ...]]]) -> tuple[list[str], dict[str, Any]]:
    """The gaps of `apis`, each (module, name, keyword parameters it must take), on the installed
    release: a module whose import raises, a name it lacks, or a signature without those keywords
    (or unreadable), one item each as a user would look it up; and the modules imported (None
    where the import raised), for a compat's further questions of them. A `missing()` helper."""
    gaps: list[str] = []
    modules: dict[str, Any] = {}
    for module, name, params in apis:
        if module not in modules:
            try:
                modules[module] = importlib.import_module(module)
            except Exception as exc:  # a broken install raises whatever it raises
                modules[module] = None
                gaps.append(f"{module} (its import raised {type(exc).__name__}: {exc})")
        if modules[module] is not None and _lacks(modules[module], name, params):
            gaps.append(f"{module}.{name}" + (f"({', '.join(p + '=' for p in params)})" if params else ""))
    return gaps, modules


def _lacks(owner: Any, name: str, params: tuple[str, ...]) -> bool:
    value = getattr(owner, name, None)
    if value is None:
        return True
    if not params:
        return False
    try:
        have = inspect.signature(value).parameters
    except (TypeError, ValueError):
        return True  # a signature that cannot be read cannot be shown to take them
    return not set(params) <= set(have)


def require(compat_module: str, what: str) -> None:
    """Raises Unsupported where the installed releases cannot run `what` (a case's name): out of
    range, or an API this integration needs missing. Called from a case's `validate`."""
    compat = importlib.import_module(compat_module)
    reason = outside(compat.RELEASES)
    if reason is not None:
        raise Unsupported(f"{what} needs {reason}")
    missing = probe(compat_module)
    if missing:
        installed = ", ".join(f"{r.distribution} {installed_release(r.distribution)}" for r in compat.RELEASES
                              if installed_release(r.distribution) is not None)
        raise Unsupported(f"{what} needs {'; '.join(missing)}, which {installed} lacks "
                          f"(supported: {', '.join(r.describe() for r in compat.RELEASES)})")


@dataclass(kw_only=True, frozen=True)
class ShippedBug:
    """A training-step bug a framework shipped in a release, and the release that fixed it."""

    distribution: str
    """The distribution that shipped it, e.g. 'transformers'."""
    first: str
    """The oldest release of the supported range that has it (the bug may be older)."""
    fixed: str | None
    """The first release without it; None where no release of the declared range fixes it yet
    (the newest release checked ships it)."""
    stage: str
    """Where the check catches it on a release that has it (`Outcome.caught_by`: 'grad',
    'reported loss', 'grad norm', ...)."""
    summary: str
    """What the bug does, in a line."""
    source: str
    """Its public report or fix (an issue or PR URL)."""

    def present(self) -> bool:
        """Whether the installed release has it (False where the distribution is not installed)."""
        release = installed_release(self.distribution)
        if release is None or release_key(release) < release_key(self.first):
            return False
        return self.fixed is None or release_key(release) < release_key(self.fixed)

    def stage_here(self) -> str:
        """Where the check catches its release case on the installed release: `stage` (a case
        whose config shows other bugs too says which is caught first there)."""
        return self.stage


@dataclass(kw_only=True, frozen=True)
class ShownWith(ShippedBug):
    """A `ShippedBug` as its release case's config shows it: that config also FAILs on the releases
    of the other bugs it shows (`also`), so its expected verdict is FAIL wherever any of them is
    present (the engine's uneven micro-batches show every one of the HF Trainer's accumulation bugs:
    no config shows one and hides another), at the stage of whichever the check judges first."""

    also: tuple[ShippedBug, ...] = ()
    """The other bugs (same distribution) the case's config shows."""

    def __post_init__(self) -> None:
        for bug in self.also:
            if bug.distribution != self.distribution:
                raise ValueError(f"{self.source}: a bug shown with it must be of {self.distribution}, "
                                 f"got {bug.distribution} ({bug.source})")

    def present(self) -> bool:
        return super().present() or any(bug.present() for bug in self.also)

    def stage_here(self) -> str:
        """The stage of the first present bug in the order the training-step check judges its
        stages (`stage` where none is present): on 4.47.0 the grads-divided-twice case FAILs at
        the reported loss, through #35207, before its own bug's grads are judged."""
        from sp_harness.checks.train_step import STAGE_LABEL

        order = ["crash", *STAGE_LABEL.values()]  # a crash stops the run before any stage is judged
        present = [b.stage for b in (self, *self.also) if ShippedBug.present(b)]
        return min(present, key=order.index) if present else self.stage


def shown_with(bug: ShippedBug, *also: ShippedBug) -> ShownWith:
    """`bug`, expected to FAIL its release case also where any of `also` is present."""
    return ShownWith(**{f.name: getattr(bug, f.name) for f in dataclasses.fields(ShippedBug)}, also=also)


def release_case(base: Case, *, name: str, bug: ShippedBug, fields: tuple[tuple[str, Any], ...], note: str) -> Case:
    """A release case: correct case `base` on the config (`fields`) that shows `bug`, registered
    under `name`, whose expected verdict follows the installed release: FAIL where the release has
    the bug, PASS where it is fixed. Its `killed_by` is `bug.stage_here()`, read here, at
    registration: the stage the installed release's bug is caught at. The main job checks it on
    the pinned release; the release matrix on each (`sp-harness releases`)."""
    if not name.startswith("release-"):
        raise ValueError(f"release case names start with 'release-', got {name!r}")
    return register(dataclasses.replace(
        base, name=name, description=f"RELEASE {bug.distribution} {bug.first} to "
                                  f"{'now (no release fixes it yet)' if bug.fixed is None else f'before {bug.fixed}'}: "
                                  f"{bug.summary}",
        models_bug=bug.summary, source=bug.source, tags=tuple(dict.fromkeys((*base.tags, "release"))),
        killed_by=(bug.stage_here(),), expect=lambda config: "FAIL" if bug.present() else "PASS",
        examples=(Example(fields=fields, note=note),)))


if __name__ == "__main__":  # the probe's child: prints missing() (or the function named) as one JSON line
    print(json.dumps(list(getattr(importlib.import_module(sys.argv[1]), sys.argv[2])())))
