"""Stage: top. The flow of the engine, stated once.

`STAGES` lists `harness/`'s stage folders bottom to top: a module imports only from its own stage
and those before it (tests/test_layout.py), and its docstring starts "Stage: <its folder>.".
The modules beside the folders (`cli.py`, `pytest_plugin.py`, this one) are the top: they may
import anything. docs/architecture.md's module map lists the same stages in the same order (a
test compares them).
"""

STAGES = ("config", "launch", "step", "capture", "compare", "record", "judge", "train", "checks", "report", "suites")
"""Bottom to top: what a case and a run are; rank processes; one rank-side step of reference and
sharded model; what a step observes; the tolerance model; records on disk; verdicts and gates;
lockstep training and its gate; the checks; reports; what runs many checks."""

TOP = "top"
"""The stage of the modules beside the stage folders."""
