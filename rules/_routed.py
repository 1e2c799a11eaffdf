"""Names shared by the rules that route a kernel call through the runtime (KVP106 for FA3's
keyword calls, KVP108 for sgl-kernel's positional paged MLA decode): both hand the pool on
as stored through one runtime function, spelled here once. A module of rules/ whose name
starts with `_` is no rule (the loader skips it), so both may import it."""

# The cast's runtime function: the pool as stored (KVPATCH_MODE=off: the whole cast); the
# routed call decides what to cast.
ROUTED_CAST_FN = "kv_for_routed_kernel"
