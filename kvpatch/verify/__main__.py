"""`python -m kvpatch.verify ARGS` is `kvpatch verify ARGS`: one CLI, one set of
option names (kvpatch/cli/commands.py), not a second front end."""

from __future__ import annotations

import sys

from kvpatch.__main__ import run

if __name__ == "__main__":
    run(["verify", *sys.argv[1:]])
