"""kvpatch: find, rewrite and verify full-pool FP8 KV-cache casts in SGLang."""

__version__ = "0.1.0"

# Bumped whenever a rule's matching or rewrite changes; recorded in state.json.
RULESET_VERSION = "1"
