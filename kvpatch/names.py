"""names: every name kvpatch matches in SGLang or writes into a checkout, spelled once.

What SGLang and FlashInfer call things (the KV getters, the casts, the MLA
wrapper), what kvpatch injects (the runtime module and its alias) and where it
keeps its own files (the ``.kvpatch/`` layout). Statuses and records live in
``kvpatch.sites``, exit codes in ``kvpatch.output.exitcodes``. A rule names its own
runtime calls (``Rule.EMITS``); nothing here names a rule.
"""

from __future__ import annotations

# -- SGLang's KV pool: the getters whose result is a whole layer's cache.
KEY_GETTER = "get_key_buffer"
VALUE_GETTER = "get_value_buffer"
KV_GETTER = "get_kv_buffer"  # returns (k, v)
MLA_KV_GETTER = "get_mla_kv_buffer"
POOL_GETTERS = frozenset({KEY_GETTER, VALUE_GETTER})
TUPLE_GETTERS = frozenset({KV_GETTER})
KV_GETTERS = POOL_GETTERS | TUPLE_GETTERS | {MLA_KV_GETTER}

# -- Tensor casts: `.to(D)`, `.type(D)` and the methods named after a dtype.
CAST_TO = "to"
CAST_TYPE = "type"
DTYPE_CAST_METHODS = frozenset({"float", "half", "bfloat16", "double"})
CAST_CALLS = DTYPE_CAST_METHODS | {CAST_TO, CAST_TYPE}

# -- FlashInfer's MLA wrapper, and SGLang's own plan functions for it (called
# with the wrapper first, or bound to it as `wrapper.plan = partial(f, wrapper)`).
MLA_WRAPPER = "BatchMLAPagedAttentionWrapper"
PLAN_METHOD = "plan"
MLA_PLAN_FUNCTIONS = ("fast_mla_decode_plan", "fast_mla_prefill_plan")

# -- SGLang's model runner: what an attention backend's `__init__` receives, and
# the KV-cache dtype it knows (kvpatch/rewrite/initattr.py keeps it on the instance).
MODEL_RUNNER_PARAM = "model_runner"
MODEL_RUNNER_CLASS = "ModelRunner"  # in a parameter's annotation
KV_CACHE_DTYPE = "kv_cache_dtype"

# -- The runtime module kvpatch writes next to each patched backend.
RUNTIME_MODULE = "_kvpatch_runtime"
RUNTIME_FILENAME = RUNTIME_MODULE + ".py"
RUNTIME_ALIAS = "_kvpatch_rt"  # `from . import _kvpatch_runtime as _kvpatch_rt`
RUNTIME_VERSION_VAR = "__kvpatch_runtime_version__"
KVPATCH_VERSION_VAR = "__kvpatch_version__"
# The runtime's mode switch, and the modes verify drives (the runtime itself, which
# imports nothing of kvpatch, lists its own in runtime/_modes.py: test_runtime_parts
# checks the two agree).
MODE_ENV = "KVPATCH_MODE"
# Extra rule folders (os.pathsep between); kvpatch/rule.py reads it, the CLI and config name it.
RULES_PATH_ENV = "KVPATCH_RULES_PATH"
MODE_AUTO, MODE_FUSED, MODE_GATHER, MODE_NATIVE = "auto", "fused", "gather", "native"

# Byte markers of a file that may hold a site: a KV-buffer read, or kvpatch's
# own rewrite (which imports the runtime module and calls through its alias).
CANDIDATE_MARKERS = tuple(sorted(KV_GETTERS)) + (RUNTIME_MODULE, RUNTIME_ALIAS)

# -- kvpatch's own files inside a checkout: .kvpatch/{state.json, journal.json,
# originals/, txn/}.
STATE_DIR = ".kvpatch"
STATE_FILE = "state.json"
JOURNAL_FILE = "journal.json"
ORIGINALS = "originals"
TXN_DIR = "txn"

# How a scan names a file whose bytes it could not get (apply refuses the whole
# apply over one: kvpatch/checkout/envfail.py).
CANNOT_READ = "cannot read"

# -- Folders never descended into: VCS data, caches, our own state, virtualenvs.
DOT_GIT = ".git"
SKIP_DIRS = frozenset({DOT_GIT, ".hg", ".svn", "__pycache__", STATE_DIR, ".tox", ".nox",
                       ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"})
