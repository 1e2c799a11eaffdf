"""A part of the kvpatch runtime: the test hooks (reset, poison_shadows).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

from kvpatch.runtime._modes import (
    _probe_cache,
    _shadow_users,
    _shadows,
    _triton_failed,
    _warned,
)
from kvpatch.runtime._route import _fused_failed, _pool_geometry
from kvpatch.runtime._pages import _page_plans
from kvpatch.runtime._fused import _fused_plans
from kvpatch.runtime._sparse import _deferred_shadows, _deferred_src

# -- joined from here --


# ---------------------------------------------------------------------------
# Test hooks


def reset():
    """Drop the cached mode, probes, warnings, shadow buffers and launch plans."""
    global _requested, _mode
    _requested = _mode = None
    _shadows.clear()
    _shadow_users.clear()
    _warned.clear()
    _probe_cache.clear()
    _triton_failed.clear()
    _fused_failed.clear()
    _deferred_shadows.clear()
    _deferred_src.clear()
    _page_plans.clear()
    _fused_plans.clear()
    _pool_geometry.clear()


def poison_shadows(value=float("nan")):
    """Fill every shadow buffer, so a row a gather missed cannot pass for a cast one."""
    for buf in list(_shadows.values()) + list(_deferred_shadows.values()):
        buf.fill_(value)
