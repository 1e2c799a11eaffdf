"""The runtime module kvpatch injects into a patched checkout.

Its source is kept here as parts, one per job, joined in the order of PARTS into the one
self-contained module ``apply`` writes next to each patched backend as
``_kvpatch_runtime.py``, stamped with the kvpatch version that wrote it:

    _modes      the head: docstring, imports, version, __all__, state, probes, mode()
    _launch     Triton launches at low host cost (the compiled kernel's own launcher)
    _dispatch   the plan and run hooks a patched backend calls
    _gather     the gathered cast (Triton, or the torch fallback)
    _kernels    the Triton kernels, built on first CUDA use
    _pages      the page cast (page tables: FA3/FA4, MUSA, XPU)
    _sparse     the deferred cast, cast next to each sparse kernel (NSA class helpers)
    _fused_ops  the fused FP8 MLA attention's device functions (row loads, FP8 conversions)
    _fused_kernels  its Triton kernels (issue 17), and the grid's split count
    _fused_gluon_ops  the Gluon split kernel's device functions (operands in MMA layouts)
    _fused_gluon    its split kernel in Gluon (16 heads, one query token), where Gluon is
    _fused_wgmma    its 64-row split kernel by warpgroup MMA (128 heads, draft tokens), Gluon
    _fused_wgmma_ws the same with its loads and conversions in a warp partition of their own
    _fused_scratch  its partial-result buffers and FP8 scale tensors, kept across calls
    _fused      its launcher (fused_mla) and tuning
    _route      routed kernel calls: the fused path, or the gather and the original kernel
    _mla_route  routed FlashInfer MLA run() calls (mla_run): fused, native or gathered
    _paged_mla  routed sgl-kernel paged MLA decode calls (paged_mla, XPU): fused or gathered
    _reset      the test hooks

A part keeps what lies between its ``# -- joined from here --`` line (or its start) and
its ``# -- joined up to here --`` line (or its end); what lies outside (a part's docstring,
its imports of the other parts) only lets it read alone. A new part is one more entry
in PARTS. The parts are never imported by kvpatch (they need torch).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from kvpatch import __version__
from kvpatch.names import KVPATCH_VERSION_VAR, RUNTIME_FILENAME, RUNTIME_MODULE, RUNTIME_VERSION_VAR

# RUNTIME_FILENAME is re-exported: kvpatch/patch.py and the tests take it from here.
__all__ = ["PARTS", "RUNTIME_FILENAME", "TEMPLATE", "load_template", "runtime_source", "runtime_version"]

PARTS = ("_modes", "_launch", "_dispatch", "_gather", "_kernels", "_pages", "_sparse", "_fused_ops", "_fused_kernels",
         "_fused_gluon_ops", "_fused_gluon", "_fused_wgmma", "_fused_wgmma_ws", "_fused_scratch", "_fused", "_route", "_mla_route", "_paged_mla", "_reset")
_HERE = Path(__file__).resolve().parent
_FROM = "# -- joined from here --\n"
_UP_TO = "# -- joined up to here --\n"
_STAMP = re.compile(rf'^{KVPATCH_VERSION_VAR} = "[^"]*"$', re.M)
_VERSION = re.compile(rf'^{RUNTIME_VERSION_VAR} = "([^"]*)"$', re.M)


def _body(text: str) -> str:
    """What a part contributes: between its 'joined from here' and 'joined up to here' lines."""
    if _FROM in text:
        text = text.split(_FROM, 1)[1]
    return text.split(_UP_TO, 1)[0]


@lru_cache(maxsize=None)
def joined() -> str:
    """The runtime source as injected, before the version stamp."""
    return "".join(_body((_HERE / f"{part}.py").read_text(encoding="utf-8")) for part in PARTS)


@lru_cache(maxsize=None)
def _template() -> Path:
    """The joined source as a real file (Triton reads a kernel's source from its file),
    in a private directory removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="kvpatch-runtime-"))
    atexit.register(shutil.rmtree, where, True)
    path = where / RUNTIME_FILENAME
    path.write_text(joined(), encoding="utf-8")
    return path


def __getattr__(name: str):
    # TEMPLATE: the joined runtime as a file, written on first use (tests and benchmarks
    # read it, or run it in a subprocess).
    if name == "TEMPLATE":
        return _template()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_template(module_name: str = RUNTIME_MODULE):
    """Import the joined runtime source as a module (tests, benchmarks): it needs
    torch, so it is never imported by kvpatch itself."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, _template())
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def runtime_source() -> str:
    text = joined()
    stamped, n = _STAMP.subn(f'{KVPATCH_VERSION_VAR} = "{__version__}"', text, count=1)
    if n != 1:
        raise RuntimeError(f"{_HERE / PARTS[0]}.py has no {KVPATCH_VERSION_VAR} line to stamp")
    return stamped


def runtime_version(text: str = "") -> str:
    """The __kvpatch_runtime_version__ of a runtime source (ours by default)."""
    m = _VERSION.search(text or joined())
    return m.group(1) if m else "unknown"
