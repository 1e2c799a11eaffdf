"""kvpatch: find, rewrite and verify full-pool FP8 KV-cache casts in SGLang."""

import os as _os

__version__ = "0.1.0"

# Bumped whenever a rule's matching or rewrite changes; recorded in state.json.
RULESET_VERSION = "1"

# rules/ sits beside this package in a source checkout and is installed as
# kvpatch.rules; when kvpatch is imported from the source tree itself (e.g.
# `python -m pytest` in a clone, next to an installed copy), find it there.
_here = __path__[0]  # noqa: F821 - set by the import system
if not _os.path.isdir(_os.path.join(_here, "rules")) and _os.path.isfile(
        _os.path.join(_os.path.dirname(_here), "rules", "__init__.py")):
    __path__.append(_os.path.dirname(_here))  # noqa: F821
