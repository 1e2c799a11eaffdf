"""One CLI: `python -m kvpatch.verify` is `kvpatch verify`, with its option names."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def _py(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_python_m_kvpatch_verify_is_kvpatch_verify(tmp_path):
    one = _py("-m", "kvpatch.verify", "--help")
    two = _py("-m", "kvpatch", "verify", "--help")
    assert one.returncode == two.returncode == 0
    assert one.stdout == two.stdout and "Usage: kvpatch verify" in one.stdout
    old = _py("-m", "kvpatch.verify", "--device", "cpu", str(tmp_path))  # the old front end's option
    assert old.returncode == 2 and "No such option '--device'" in old.stderr


# An importer that raises KeyboardInterrupt the moment the CLI pulls in click: a
# Ctrl-C landing while the CLI is still loading, made deterministic (CI's 3.10 leg
# once hit it by chance in test_faults' random SIGINT and printed a traceback). click,
# not libcst: every command loads click first, while libcst is loaded only once a
# command needs it (verify checks its path before that).
_INTERRUPT_DURING_IMPORT = """
import runpy, sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
sys.argv = [sys.argv[0], {args}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_cli_loads_is_exit_130_without_a_traceback(tmp_path):
    for module, args in (("kvpatch", f"'audit', {str(tmp_path)!r}"),
                         ("kvpatch.verify", f"'--cpu', {str(tmp_path)!r}")):
        p = _py("-c", _INTERRUPT_DURING_IMPORT.format(module=module, args=args))
        assert p.returncode == 130, (module, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and "interrupted" in p.stderr, (module, p.stderr)


def test_the_kvpatch_script_is_the_entry_that_handles_it():
    # The console script must start at run(), not at cli.main, or the fix above
    # covers `python -m kvpatch` only.
    text = (REPO / "pyproject.toml").read_text()
    assert 'kvpatch = "kvpatch.__main__:run"' in text
