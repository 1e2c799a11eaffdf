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
