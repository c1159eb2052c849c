"""Built-in cases are registered lazily (issue 22): `import sp_harness.cases` imports no case,
a lookup imports the module of the case looked up, and the table in sp_harness.cases names
exactly what its modules register."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import sp_harness.cases as cases
imported = sorted(m for m in sys.modules if m.startswith("sp_harness.cases."))
from sp_harness.config.registry import _REGISTRY, all_cases, get_case
get_case("ring-gpt")
after_lookup = sorted(_REGISTRY)
everything = sorted(all_cases())
print(json.dumps(dict(imported=imported, after_lookup=after_lookup, everything=everything,
                      table=sorted(cases.builtin_modules()))))
"""


def test_cases_register_lazily_and_the_table_names_what_registers():
    # a fresh interpreter: this test process may have registered cases already
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["imported"] == ["sp_harness.cases.frameworks"]  # no case module on import
    assert seen["after_lookup"] == ["ring-gpt"]
    assert seen["everything"] == seen["table"]
