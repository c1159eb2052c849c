"""Whether an optional framework is installed, found without importing it.

`pytest.importorskip` imports the framework into every xdist worker at collection: megatron-core
takes 20 s there and starts wandb, whose temp dirs outlive a worker that xdist has to kill. The
framework tests run their framework on ranks, which import it themselves."""

import importlib.util

import pytest


def skip_unless_installed(module: str, reason: str) -> None:
    """Skips the calling test module unless `module` (dotted names allowed) can be found."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        pytest.skip(reason, allow_module_level=True)
