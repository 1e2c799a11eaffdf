"""verify's sandbox serves a file's original from text, not from a file on disk: what it
defines must still give its source to inspect, as Triton's @jit asks of a kernel (an FA3
backend of 2026-01 defines one at module level; verify could not import its original)."""

import inspect

import pytest

pytest.importorskip("torch", reason="verify's sandbox needs torch")

from kvpatch.verify.stubs import Sandbox  # noqa: E402

SOURCE = '''
def kernel(x):
    # a module-level function, as a Triton kernel would be
    return x + 1
'''


def test_a_function_of_a_module_loaded_from_text_gives_its_source():
    with Sandbox() as sandbox:
        mod = sandbox.load("kvpatch_sandbox_probe", SOURCE, "<original git 93422f27d:backend.py>")
    assert mod.kernel(1) == 2
    lines, start = inspect.getsourcelines(mod.kernel)
    assert "".join(lines) == SOURCE.lstrip("\n") and start == 2
