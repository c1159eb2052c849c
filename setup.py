"""Packaging: the one import package `sp_harness` over the design card's top-level folders.

`sp_harness` is `harness/`, `sp_harness.cases` is `cases/`, `sp_harness.reference` is
`reference/`, so the installed names cannot collide with a user's own `harness`, `cases` or
`reference` packages. Every folder with an `__init__.py` under them is a package (found here, not
listed by hand).

`pip install -e .` makes a strict editable install by default: a tree of links to the source files
(under build/), not setuptools' import hook, so static tools (mypy, pyright, IDEs) resolve
`sp_harness.*` to the files here. Edits show at once; a new or renamed module needs the install
command again. `--config-settings editable_mode=lenient` restores the hook."""

from setuptools import find_packages, setup
from setuptools.command.editable_wheel import editable_wheel

ROOTS = {"sp_harness": "harness", "sp_harness.cases": "cases", "sp_harness.reference": "reference"}


def packages() -> list[str]:
    return [f"{name}.{sub}" if sub else name
            for name, folder in ROOTS.items() for sub in ["", *sorted(find_packages(folder))]]


class StrictEditable(editable_wheel):
    """`pip install -e .` as a link tree (see the module docstring) unless a mode is asked for."""

    def finalize_options(self) -> None:
        # the import hook (lenient mode) is invisible to static tools: the mapped folders have no
        # `sp_harness` directory for them to find
        self.mode = self.mode or "strict"
        super().finalize_options()


setup(packages=packages(), package_dir=ROOTS, package_data={"sp_harness": ["py.typed"]},
      cmdclass={"editable_wheel": StrictEditable})
