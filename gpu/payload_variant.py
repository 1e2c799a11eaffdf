"""Copy the GPU payload with one runtime setting flipped, to verify a variant on the real trees.

    python gpu/payload_variant.py .gpu_payload .gpu_payload_ws '    "ws": True,' '    "ws": False,'

Every injected ``_kvpatch_runtime.py`` under SRC must hold the line OLD exactly once; it
becomes NEW in the copy under DEST (DEST is replaced). Anything else fails, so a renamed or
moved setting never yields a "variant" that is the default. Carry DEST with the run and point
verify at it: ``PAYLOAD=.gpu_payload_ws bash gpu/run_all.sh verify``. DEST holds SGLang code
like SRC (git-ignored as ``.gpu_payload*/``): never commit it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpatch.names import RUNTIME_FILENAME  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, dest, old, new = Path(argv[0]), Path(argv[1]), argv[2], argv[3]
    runtimes = sorted(src.rglob(RUNTIME_FILENAME))
    if not runtimes:
        print(f"payload_variant: no {RUNTIME_FILENAME} under {src}", file=sys.stderr)
        return 1
    for f in runtimes:
        lines = f.read_text(encoding="utf-8").split("\n")
        if lines.count(old) != 1:
            print(f"payload_variant: {f} holds {old!r} {lines.count(old)} times, not once", file=sys.stderr)
            return 1
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    for f in runtimes:
        g = dest / f.relative_to(src)
        lines = g.read_text(encoding="utf-8").split("\n")
        lines[lines.index(old)] = new
        g.write_text("\n".join(lines), encoding="utf-8")
    print(f"{dest}: {len(runtimes)} runtime file(s) with {new.strip()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
