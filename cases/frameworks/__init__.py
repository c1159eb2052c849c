"""Framework integrations: a framework's own configuration turned into a `Case`.

Not imported by `sp_harness.cases` (nothing here registers a built-in case, and each module
needs its framework installed: `pip install sp-harness[megatron]`). A user imports the one they
need, e.g. `from sp_harness.cases.frameworks.megatron_core import megatron_case`.
"""
