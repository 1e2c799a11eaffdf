"""Import sandbox: load a checkout's backend file with the rest of SGLang stubbed.

A meta-path finder serves every ``sglang.*`` module as a stub, except the file
under test (served from the checkout) and its sibling ``_kvpatch_runtime``
(served from the checkout's injected copy). A stub module hands out, for any
name, either a real implementation from ``REAL`` (what the verified math needs)
or a falsy null object that can be called, indexed and walked into. When real
FlashInfer is not used, ``flashinfer`` is a stub that serves the reference
wrapper.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import sys
import types
from typing import Callable, Dict, Optional

import torch

from kvpatch.names import RUNTIME_MODULE

from . import fakes
from .aiter_reference import REAL as AITER_REAL
from .fa3_reference import REAL as FA3_REAL
from .sparse_reference import REAL as SPARSE_REAL


class Null:
    """Falsy stand-in for any SGLang name the verified paths do not need."""

    __slots__ = ("_name",)

    def __init__(self, name: str = "stub"):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Null(f"{self._name}.{attr}")

    def __setattr__(self, attr, value):
        pass

    def __call__(self, *args, **kwargs):
        return Null(f"{self._name}()")

    def __getitem__(self, key):
        return Null(f"{self._name}[{key!r}]")

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __mro_entries__(self, bases):
        # `class Backend(AttentionBackend)` with a stubbed base: subclass a plain class.
        return (_plain_base(self._name),)

    def __repr__(self):
        return f"<kvpatch stub {self._name}>"


_BASES: Dict[str, type] = {}


def _plain_base(name: str) -> type:
    short = name.rsplit(".", 1)[-1] or "Stub"
    if name not in _BASES:
        _BASES[name] = type(short, (object,), {"__module__": "kvpatch.verify.stubs"})
    return _BASES[name]


class Namespace:
    """Fixed attributes; anything else is a Null (a config object of SGLang's)."""

    def __init__(self, name: str, **fields):
        self.__dict__.update(fields)
        self.__dict__["_name"] = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Null(f"{self._name}.{attr}")


# --- real implementations the math needs -------------------------------------


def _next_power_of_2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 1


PARALLEL = Namespace(
    "get_parallel()", dcp_enabled=False, attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1,
    attn_dcp_rank=0, dcp_size=1, dcp_rank=0, tp_size=1, tp_rank=0, dp_size=1,
)

def set_dcp(size: int, rank: int = 0, planner_translates: bool = True) -> None:
    """Run the next cases as DCP rank ``rank`` of ``size`` (1: no DCP)."""
    fakes.DCP.size, fakes.DCP.rank, fakes.DCP.planner_translates = size, rank, planner_translates
    for f in ("attn_dcp_size", "dcp_size"):
        setattr(PARALLEL, f, size)
    for f in ("attn_dcp_rank", "dcp_rank"):
        setattr(PARALLEL, f, rank)
    PARALLEL.dcp_enabled = size > 1


# By attribute name, whichever sglang module it is imported from (these names
# moved between modules across SGLang versions; the names stayed).
REAL: Dict[str, object] = {
    "create_flashinfer_kv_indices_triton": fakes.KV_INDICES_KERNEL,
    # Compared and isinstance-checked by the speculative paths: real classes.
    "SpecInputType": fakes.SpecInputType,
    "SpecInput": fakes.SpecInput,
    "SpecInfo": fakes.SpecInput,
    "EagleVerifyInput": fakes.EagleVerifyInput,
    "EagleDraftInput": fakes.EagleDraftInput,
    "is_flashinfer_available": lambda: True,
    "get_parallel": lambda: PARALLEL,
    "get_attention_tp_size": lambda: 1,
    "get_attention_tp_rank": lambda: 0,
    "get_attention_dcp_world_size": lambda: fakes.DCP.size,
    "get_attention_dcp_rank": lambda: fakes.DCP.rank,
    "dcp_enabled": lambda: fakes.DCP.size > 1,
    "update_local_kv_lens_for_dcp": fakes.update_local_kv_lens_for_dcp,
    "plan_dcp_decode_metadata": fakes.plan_dcp_decode_metadata,
    "is_sm100_supported": lambda *a, **k: False,
    "is_sm90_supported": lambda *a, **k: torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] == 9,
    "next_power_of_2": _next_power_of_2,
    # The page-table kernels (sgl-kernel FA3, SGLang's paged_view), see fa3_reference.
    **FA3_REAL,
    # aiter's MHA prefill kernel (no ROCm GPU here), and the FP8 dtype SGLang names it by.
    **AITER_REAL,
    # NSA's sparse kernels and its top-k index transforms (KVP105's helpers), see sparse_reference.
    **SPARSE_REAL,
    "fp8_dtype": torch.float8_e4m3fn,
}
# Top-level packages always served as stubs: sgl-kernel does not load on the machines
# verify runs on, and the page-table family calls it (merge_state_v2, FA3); MUSA's FA3
# comes from flash_attn_interface (MATE), whose flash_attn_with_kvcache is served by the
# same reference, so both sides of a MUSA file run one kernel. msgspec: SGLang 0.5.23's XPU
# backend subclasses msgspec.Struct for its DCP metadata (a dependency verify does not need).
# flash_mla: NSA's helpers of 2025-10 import FlashMLA's kernels from it (served by sparse_reference).
STUB_PACKAGES = ("sglang", "sgl_kernel", "flash_attn_interface", "msgspec", "aiter", "flash_mla")

# Environment the module expects at import (old versions index os.environ).
ENV_DEFAULTS = {"SGLANG_ENABLE_TORCH_COMPILE": "0"}


class StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        sandbox = self.__dict__.get("_kvpatch_sandbox")
        if sandbox is not None and f"{self.__name__}.{attr}" in sandbox._serve:
            raise AttributeError(attr)  # a served submodule: let import find it
        value = REAL.get(attr)
        if value is None:
            value = Null(f"{self.__name__}.{attr}")
        setattr(self, attr, value)  # same object on every import
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, make: Callable[[types.ModuleType], None], cls=types.ModuleType):
        self._make, self._cls = make, cls

    def create_module(self, spec):
        return self._cls(spec.name)

    def exec_module(self, module):
        self._make(module)


class _SourceLoader(importlib.abc.Loader):
    def __init__(self, source: str, filename: str):
        self.source, self.filename = source, filename

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = self.filename
        # An original is no file on disk ("<original ...>"): give linecache its lines, so that
        # inspect.getsource works on what it defines. Triton's @jit reads its function's
        # source that way, and refuses a module-level kernel without it (an FA3 backend of
        # 2026-01 defines one).
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True), self.filename)
        exec(compile(self.source, self.filename, "exec", dont_inherit=True), module.__dict__)


def _is_under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


class Sandbox(importlib.abc.MetaPathFinder):
    """Active between ``open()`` and ``close()``; restores sys.modules after."""

    def __init__(self, flashinfer_stub: Optional[types.ModuleType] = None):
        self.flashinfer_stub = flashinfer_stub
        self._serve: Dict[str, importlib.abc.Loader] = {}
        self._saved: Dict[str, types.ModuleType] = {}
        self._env_set = []
        self._exec_only: set = set()
        self._open = False

    def _owned(self, name: str) -> bool:
        return any(_is_under(name, top) for top in STUB_PACKAGES) or (
            self.flashinfer_stub is not None and _is_under(name, "flashinfer"))

    def open(self) -> "Sandbox":
        for name in list(sys.modules):
            if self._owned(name):
                self._saved[name] = sys.modules.pop(name)
        for k, v in ENV_DEFAULTS.items():
            if k not in os.environ:
                os.environ[k] = v
                self._env_set.append(k)
        sys.meta_path.insert(0, self)
        self._open = True
        return self

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in list(sys.modules):
            if self._owned(name) or name in self._serve:
                del sys.modules[name]
        sys.modules.update(self._saved)
        for k in self._env_set:
            os.environ.pop(k, None)

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()

    # -- finder -------------------------------------------------------------

    def find_spec(self, fullname, path=None, target=None):
        loader = self._serve.get(fullname)
        if loader is not None:
            return importlib.machinery.ModuleSpec(fullname, loader, origin=getattr(
                loader, "filename", None))
        if any(_is_under(fullname, top) for top in self._exec_only):
            return importlib.machinery.ModuleSpec(
                fullname, _Loader(self._make_stub, StubModule), is_package=True)
        if self.flashinfer_stub is not None and _is_under(fullname, "flashinfer"):
            return importlib.machinery.ModuleSpec(
                fullname, _Loader(self._make_flashinfer), is_package=True)
        if any(_is_under(fullname, top) for top in STUB_PACKAGES):
            return importlib.machinery.ModuleSpec(
                fullname, _Loader(self._make_stub, StubModule), is_package=True)
        return None

    def _make_stub(self, module):
        module.__path__ = []
        module.__kvpatch_stub__ = True
        module._kvpatch_sandbox = self

    def _make_flashinfer(self, module):
        module.__path__ = []
        module.__kvpatch_stub__ = True
        module.__version__ = "0.0.0+kvpatch.reference"  # never "FlashInfer >= 0.6.14"
        for k, v in vars(self.flashinfer_stub).items():
            if not k.startswith("__"):
                setattr(module, k, v)

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Null(f"{module.__name__}.{attr}")
        module.__getattr__ = __getattr__

    # -- loading ------------------------------------------------------------

    def load(self, modname: str, source: str, filename: str,
             runtime_path: Optional[str] = None) -> types.ModuleType:
        """Execute ``source`` as module ``modname``; return it, then unregister it.

        The returned module keeps working after being dropped from sys.modules
        (its globals hold what it imported), so the original and the patched
        file can both be loaded under the same name, one after the other.
        """
        pkg = modname.rpartition(".")[0]
        rt_name = f"{pkg}.{RUNTIME_MODULE}" if pkg else RUNTIME_MODULE
        self._serve[modname] = _SourceLoader(source, filename)
        if runtime_path is not None:
            with open(runtime_path, encoding="utf-8") as f:
                self._serve[rt_name] = _SourceLoader(f.read(), str(runtime_path))
        # Stub top-level packages the file imports but this machine lacks
        # (old versions `import triton` at top, FA3 `import numpy`), only while it executes, so
        # that the runtime's own lazy `import triton` never sees a stub. torch's lazy
        # modules probe numpy too (FA3's `@torch.compile` and `@torch._dynamo.disable()`
        # at import): load them first, while the probe still finds no numpy.
        missing = {n for n in ("triton", "numpy") if importlib.util.find_spec(n) is None}
        if missing and ("torch.compile" in source or "torch._dynamo" in source):  # (and triton: aiter's)
            torch.compile(len)
            torch._dynamo.disable()(len)
        self._exec_only = missing
        try:
            for name in (modname, rt_name):
                sys.modules.pop(name, None)
                parent = sys.modules.get(name.rpartition(".")[0])
                if parent is not None:
                    parent.__dict__.pop(name.rpartition(".")[2], None)
            return importlib.import_module(modname)
        finally:
            for name in list(sys.modules):
                if any(_is_under(name, t) for t in self._exec_only):
                    del sys.modules[name]
            self._exec_only = set()
            sys.modules.pop(modname, None)
            sys.modules.pop(rt_name, None)
            self._serve.pop(modname, None)
            self._serve.pop(rt_name, None)


class DeviceRedirectTorch(types.ModuleType):
    """`torch` for a module run on CPU: factory calls that name "cuda" get "cpu".

    Some SGLang versions hard-code ``device="cuda"`` (e.g. the decode updater's
    kv_indices). Only the CPU reference path installs this, in the module's own
    globals; the runtime and everything else see the real torch.
    """

    FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "randn", "rand")

    def __init__(self, device):
        super().__init__("torch")
        self._device = torch.device(device)

    def __getattr__(self, attr):
        value = getattr(torch, attr)
        if attr in self.FACTORIES:
            def factory(*args, _f=value, **kwargs):
                d = kwargs.get("device")
                if d is not None and torch.device(d).type == "cuda":
                    kwargs["device"] = self._device
                return _f(*args, **kwargs)
            return factory
        return value


def module_name_for(rel: str) -> str:
    """Dotted module name of a checkout file (python/sglang/srt/x.py -> sglang.srt.x)."""
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    if "sglang" in parts:
        parts = parts[parts.index("sglang"):]
    else:
        parts = ["sglang", "_kvpatch_verify", parts[-1]]
    return ".".join(parts)
