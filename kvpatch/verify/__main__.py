"""`python -m kvpatch.verify ARGS` is `kvpatch verify ARGS`: one CLI, one set of
option names (kvpatch/cli.py), not a second front end."""

from __future__ import annotations

import sys

from kvpatch.cli import main

if __name__ == "__main__":
    main(["verify", *sys.argv[1:]], prog_name="kvpatch")
