"""With sp-harness merely installed, an unrelated project's tests run as if it were not: hypothesis
keeps its own default profile, no SP_HARNESS_* variable appears, and a profile of the project's
own named like ours (`ci`) is its own (issue 21, deliverable 7), and torch is not imported."""

import os
import subprocess
import sys
import textwrap

SCRATCH_TEST = textwrap.dedent('''
    import os
    from hypothesis import given, settings, strategies as st

    settings.register_profile("ci", max_examples=7)

    def test_hypothesis_defaults_are_untouched():
        assert settings.default.max_examples == 100
        assert settings.default.deadline is not None

    def test_no_sp_harness_environment():
        assert not [k for k in os.environ if k.startswith("SP_HARNESS")]

    def test_torch_is_not_imported_for_them():
        # about 2 s of every pytest run in a project that never uses sp-harness's fixtures
        import sys
        assert "torch" not in sys.modules

    def test_own_profile_named_ci_is_its_own():
        assert settings.get_profile("ci").max_examples == 7

    @given(st.integers())
    def test_property_runs_with_hypothesis_defaults(x):
        assert isinstance(x, int)

    def test_the_plugin_is_loaded_here(pytestconfig):
        # so the tests above prove something: its entry point loaded, its options offered
        assert pytestconfig.pluginmanager.has_plugin("sp_harness")
        assert pytestconfig.getoption("--sp-timeout", default="absent") != "absent"
''')


def test_plugin_changes_nothing_in_an_unrelated_project(tmp_path):
    (tmp_path / "test_theirs.py").write_text(SCRATCH_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SP_HARNESS", "PYTEST_", "CI"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 passed" in proc.stdout, proc.stdout  # the plugin's loading among them
