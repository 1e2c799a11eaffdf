"""The runtime module kvpatch injects into a patched checkout.

``kvpatch_runtime.py`` is shipped as a source file, never imported by kvpatch
itself (it needs torch). ``apply`` copies it next to each patched backend as
``_kvpatch_runtime.py``, stamped with the kvpatch version that wrote it.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvpatch import __version__
from kvpatch.names import KVPATCH_VERSION_VAR, RUNTIME_FILENAME, RUNTIME_MODULE, RUNTIME_VERSION_VAR

# RUNTIME_FILENAME is re-exported: kvpatch/patch.py and the tests take it from here.
__all__ = ["RUNTIME_FILENAME", "TEMPLATE", "load_template", "runtime_source", "runtime_version"]

_TEMPLATE = Path(__file__).with_name("kvpatch_runtime.py")
_STAMP = re.compile(rf'^{KVPATCH_VERSION_VAR} = "[^"]*"$', re.M)
_VERSION = re.compile(rf'^{RUNTIME_VERSION_VAR} = "([^"]*)"$', re.M)


TEMPLATE = _TEMPLATE


def load_template(module_name: str = RUNTIME_MODULE):
    """Import the shipped runtime source as a module (tests, benchmarks): it needs
    torch, so it is never imported by kvpatch itself."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, _TEMPLATE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def runtime_source() -> str:
    text = _TEMPLATE.read_text(encoding="utf-8")
    stamped, n = _STAMP.subn(f'{KVPATCH_VERSION_VAR} = "{__version__}"', text, count=1)
    if n != 1:
        raise RuntimeError(f"{_TEMPLATE} has no {KVPATCH_VERSION_VAR} line to stamp")
    return stamped


def runtime_version(text: str = "") -> str:
    """The __kvpatch_runtime_version__ of a runtime source (ours by default)."""
    m = _VERSION.search(text or _TEMPLATE.read_text(encoding="utf-8"))
    return m.group(1) if m else "unknown"
