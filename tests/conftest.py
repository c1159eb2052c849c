"""This project's own test settings (a plugin must not impose them on other projects: the
sp-harness plugin only registers what is here loaded).

Two tiers (docs/benchmarks.md, "The tiers"):
- `fast`, the default (`python -m pytest -n auto`, what CI runs): every check, case, mutant pin
  and framework integration, each at its smallest config that still exercises it;
- `full` (`--tier full`, `SP_HARNESS_TIER=full`, `tox -e full`): also the tests marked
  `exhaustive` (larger meshes, more kernel families, whole mutant batteries, more hypothesis
  examples). Run it before changing a tolerance, a launcher or a framework integration.
A test left out of the fast tier is deselected, so pytest's summary line counts it.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from types import SimpleNamespace

import pytest

from sp_harness.config import profiles
from sp_harness.pytest_plugin import option

TIERS = ("fast", "full")
TIER_KEY: pytest.StashKey[str] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default=None,
                     help="fast (default): the CI tier; full: also the tests marked exhaustive (env SP_HARNESS_TIER)")


def tier_of(config: pytest.Config) -> str:
    tier = config.getoption("tier") or os.environ.get("SP_HARNESS_TIER") or "fast"
    if tier not in TIERS:
        raise pytest.UsageError(f"SP_HARNESS_TIER={tier!r}: valid are {', '.join(TIERS)}")
    return tier


def _schedule_by_file(config: pytest.Config) -> bool:
    """Under xdist, a test file's tests go to one worker (unless --dist says otherwise): they share
    that worker's warm pools and their case's setup (a framework's import), where `load` spread
    every file over both workers and each paid them."""
    args = config.invocation_params.args
    explicit = any(a in ("--dist", "-d") or str(a).startswith("--dist=") for a in args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "loadfile"
        return True
    return False


FRAMEWORK_FILES = {"test_megatron_core.py": "megatron.core", "test_megatron_step.py": "megatron.core",
                   "test_deepspeed.py": "deepspeed", "test_deepspeed_step.py": "deepspeed",
                   "test_torchtitan.py": "torchtitan", "test_torchtitan_step.py": "torchtitan",
                   "test_yunchang.py": "yunchang", "test_hf_trainer.py": "accelerate",
                   "test_hf_trainer_sp.py": "accelerate", "test_trl.py": "trl", "test_verl.py": "verl"}
"""Test files by the framework whose rank processes they run (sp_harness.cases.frameworks'
`FRAMEWORK_CASES` keys)."""

SHARED_SCOPE = {"trl": "accelerate"}
"""Frameworks whose cases share another's rank processes (`Case.isolation`): TRL's SFTTrainer runs
in the Trainer's pools ('hf-trainer'), so its tests go to the Trainer's worker and reuse them."""


def scope_of(nodeid: str) -> str:
    """The unit a worker takes whole: a framework's tests, its mutants' kills included, are one
    unit, so they share the worker's warm pools of that framework and pay its import in the ranks
    (several seconds a pool) once per world size instead of once per file; any other test goes
    with its file."""
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if name in FRAMEWORK_FILES:
        framework = FRAMEWORK_FILES[name]
        return "framework:" + SHARED_SCOPE.get(framework, framework)
    if name == "test_mutants.py" and rest.endswith("]") and "[" in rest:
        from sp_harness.cases.frameworks import FRAMEWORK_CASES

        mutant = rest[rest.index("[") + 1:-1]
        for framework, (_, names) in FRAMEWORK_CASES.items():
            if mutant in names:
                return "framework:" + SHARED_SCOPE.get(framework, framework)
    return path


BY_SCOPE_KEY = pytest.StashKey[bool]()
"""Whether this run's scheduling is ours (`_schedule_by_file` chose loadfile: no --dist was given)."""


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not config.stash.get(BY_SCOPE_KEY, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FrameworkScheduling(LoadScopeScheduling):
        """`--dist loadfile`, with each framework's tests in other files (its mutants) joined to its files."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return FrameworkScheduling(config, log)


def _compile_bytecode(config: pytest.Config) -> None:
    """Writes the package's, the tests' and the examples' bytecode once, before any worker starts.
    Where PYTHONDONTWRITEBYTECODE is set (this project's machines and CI set it) nothing else
    writes it: pip compiles the dependencies at install but not an editable install's link tree,
    so every process the suite starts (drivers, fork servers, nested pytest runs: about 80, and
    before the fork servers preloaded them, every rank) compiled the package's modules from
    source again: its import after torch's took 0.41-0.46 s against 0.17-0.26 s with bytecode.
    Python still checks each file's mtime and size against its source, so an edited file is
    recompiled, as without this."""
    if hasattr(config, "workerinput"):
        return
    import compileall
    import pathlib

    import sp_harness

    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in (*sp_harness.__path__, root / "tests", root / "examples"):
        compileall.compile_dir(str(folder), quiet=1, workers=1)


PROBE_CACHE_KEY = pytest.StashKey[str]()
"""The folder this session made for the release probes' answers (removed at its end)."""


def _share_probe_answers(config: pytest.Config) -> None:
    """The session's processes (its workers, the CLIs and nested runs its tests start) share the
    release probes' answers (sp_harness.cases.frameworks.releases.PROBE_CACHE_ENV): one folder,
    made by the controller before any worker starts, unless one is set already (a nested run)."""
    from sp_harness.cases.frameworks.releases import PROBE_CACHE_ENV

    if hasattr(config, "workerinput") or os.environ.get(PROBE_CACHE_ENV):
        return
    config.stash[PROBE_CACHE_KEY] = os.environ[PROBE_CACHE_ENV] = tempfile.mkdtemp(prefix="sp-harness-probes-")


def pytest_configure(config: pytest.Config) -> None:
    _compile_bytecode(config)
    _share_probe_answers(config)
    config.stash[BY_SCOPE_KEY] = _schedule_by_file(config)
    config.addinivalue_line("markers", "exhaustive(why): runs in the full tier only; `why` names what the fast "
                                       "tier runs instead (the same check, case, mutant or framework, smaller)")
    config.stash[TIER_KEY] = tier = tier_of(config)
    profiles.load_default(tier)
    # the CLI runs some tests start as subprocesses take the suite's job timeout too
    os.environ["SP_HARNESS_TIMEOUT"] = repr(option(config, "sp_timeout"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("exhaustive")
        if marker is not None and not (marker.args and len(str(marker.args[0])) > 10):
            raise pytest.UsageError(f"{item.nodeid}: exhaustive(why) must say what the fast tier runs instead")
    if config.stash[TIER_KEY] == "full":
        return
    dropped = [item for item in items if item.get_closest_marker("exhaustive")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its controller prints the summary line
        workeroutput[DESELECTED_KEY] = [item.nodeid for item in dropped]


DESELECTED_KEY = "sp_harness_tier_deselected"
_REPORTED: pytest.StashKey[bool] = pytest.StashKey()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `pytest -p no:xdist` must still load this file
def pytest_testnodedown(node, error) -> None:
    """On the xdist controller: count the tier's deselected tests in the summary line, as a run
    without xdist does (every worker collects, and deselects, the same tests: counted once)."""
    config = node.config
    ids = getattr(node, "workeroutput", {}).get(DESELECTED_KEY)
    if ids and not config.stash.get(_REPORTED, False):
        config.stash[_REPORTED] = True
        # stand-ins with the item's nodeid: other plugins' summaries read the reports' attributes
        config.hook.pytest_deselected(items=[SimpleNamespace(nodeid=nodeid) for nodeid in ids])


@pytest.fixture(scope="session")
def tier(request: pytest.FixtureRequest) -> str:
    """The tier this run is (`fast` or `full`)."""
    return request.config.stash[TIER_KEY]


if os.environ.get("SP_TEST_POOL_LOG"):  # measurement only: every pool start of this process, appended
    from sp_harness.launch import pool as _pool

    _start = _pool.RankPool.start

    def _logged_start(self):
        import time
        t0 = time.monotonic()
        _start(self)
        with open(os.environ["SP_TEST_POOL_LOG"], "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{self.world_size}\t"
                    f"{time.monotonic() - t0:.1f}\n")

    _pool.RankPool.start = _logged_start

    from sp_harness.launch import zygote_registry as _registry

    _first_env: dict[str, str] = {}

    class _LoggedZygote(_registry.Zygote):
        """Each fork server started (its start is waited for in the pool's start, logged above),
        and the variables in which its environment differs from this process's first one's: a
        variable that drifts in the driver starts fork servers for the same ranks again."""

        def __init__(self, env):
            super().__init__(env)
            if not _first_env:
                _first_env.update(env)
            diff = sorted(k for k in set(env) | set(_first_env) if env.get(k) != _first_env.get(k))
            with open(os.environ["SP_TEST_POOL_LOG"], "a") as f:
                f.write(f"zygote {os.getpid()} {os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t"
                        f"{','.join(diff)}\n")

    _registry.Zygote = _LoggedZygote


def pytest_unconfigure(config: pytest.Config) -> None:
    """The suite leaves nothing in /tmp: the probes' folder it made and this session's `tmp_path`
    directory (the workers' are inside the controller's) are removed, then pytest's per-user root
    once nothing else is in it.

    Not `tmp_path_retention_policy = "none"`: pytest then leaves the session's directory unlocked,
    and any other pytest session ending meanwhile (the nested runs some tests start) deletes it
    under the running suite (seen: FileNotFoundError creating a worker's basetemp)."""
    if hasattr(config, "workerinput"):
        return
    import getpass
    import shutil
    import tempfile
    from pathlib import Path

    from sp_harness.cases.frameworks.releases import PROBE_CACHE_ENV

    if PROBE_CACHE_KEY in config.stash:
        shutil.rmtree(config.stash[PROBE_CACHE_KEY], ignore_errors=True)
        os.environ.pop(PROBE_CACHE_ENV, None)

    factory = getattr(config, "_tmp_path_factory", None)  # pytest's own; None under -p no:tmpdir
    basetemp = getattr(factory, "_basetemp", None)  # None where no test asked for a tmp_path
    if basetemp is not None and getattr(factory, "_given_basetemp", None) is None:
        shutil.rmtree(basetemp, ignore_errors=True)
    root = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    try:
        for entry in root.iterdir():
            if entry.is_symlink() and not entry.exists():  # pytest-current, pointing at the removed session
                entry.unlink()
        root.rmdir()
    except OSError:  # absent, or still in use
        pass


# Child interpreters that tests start to ask a framework something (transformers' Trainer, the
# traced wrappers) import torch._inductor.config, which makes torch's inductor cache folder in
# their TMPDIR, /tmp/torchinductor_USER, empty. The release probe (the product's own child) runs in
# a temporary folder of its own; the tests' children are many, so the session removes that folder
# once, where it did not exist before the session and is still empty (never a user's cache).
_INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
_INDUCTOR_CACHE_EXISTED = os.path.exists(_INDUCTOR_CACHE)


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workerinput") or _INDUCTOR_CACHE_EXISTED:
        return  # an xdist worker (the controller cleans up), or a cache that was there already
    try:
        os.rmdir(_INDUCTOR_CACHE)  # only an empty folder: anything cached in it stays
    except OSError:
        pass
