"""Stage: config. Loading a user's case file (`path/to/file.py:NAME`) as a module.

The file runs as a script would: its own directory is importable, so a case file can import a
helper beside it; and so is its project's root (the nearest directory above it holding a
`pyproject.toml`, `setup.cfg` or `setup.py`, else the current directory), so a case file in
`myproj/cases/` imports `myproj`'s other packages without PYTHONPATH, in every rank. Anything that goes wrong while it runs (a SyntaxError, an ImportError, any
exception at its top level) is the user's input being wrong, not a harness bug: it becomes a
one-line ValueError naming the file and the error, which the CLI turns into exit 2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_case_file(path: str) -> ModuleType:
    """The module of case file `path`, executed once per process."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"case file {path!r} does not exist")
    mod_name = "sp_harness_user_" + file.stem
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
    folder, root = str(file.parent), str(project_root(file))
    if root not in sys.path:
        sys.path.insert(0, root)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # first, as for a script: its helpers win over same-named installed modules
    spec = importlib.util.spec_from_file_location(mod_name, file)
    # a path ending in .py always gets a spec with a source loader
    assert spec is not None and spec.loader is not None, f"no module spec for {file}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]  # a half-run module must not be found by the next attempt
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        if isinstance(exc, ImportError):
            message += (f" (importable beside sys.path: the case file's folder {folder} and its project root {root}; "
                        "install the package or set PYTHONPATH)")
        raise ValueError(f"case file {path} could not be loaded: {message}") from exc
    return module


PROJECT_MARKERS = ("pyproject.toml", "setup.cfg", "setup.py")


def project_root(file: Path) -> Path:
    """The nearest directory at or above `file`'s folder holding one of PROJECT_MARKERS, else the
    current directory."""
    for folder in file.resolve().parents:
        if any((folder / marker).is_file() for marker in PROJECT_MARKERS):
            return folder
    return Path.cwd().resolve()
