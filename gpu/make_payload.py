"""Build the GPU payload: real SGLang checkouts patched by `kvpatch apply`, cut
down to what `kvpatch verify` reads (the patched backend, its runtime, and
.kvpatch/ with the originals), under .gpu_payload/<sha>/.

.gpu_payload/ is git-ignored (it holds SGLang code, which is never committed);
it travels to the device machine in `carry`.

    python gpu/make_payload.py /work/.mirror/sshleifer+sglang/repo 4ad990ba7 ea8f4e9f3 2e4babdb0
    python gpu/make_payload.py --trees /work/cache/releases/0.5.16 /work/cache/releases/0.5.23

With --trees, each argument is an unpacked release (`sglang/srt/...`): it is copied,
patched and cut down to .gpu_payload/rel-<folder name>/.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(mirror: str, shas):
    # Exported as plain trees, not git worktrees: in a git checkout apply keeps the
    # originals in git (state.json names the commit), and the payload carries no .git,
    # so verify on the device could not read them. A plain tree keeps them in .kvpatch/.
    for sha in shas:
        wt = Path(f"/tmp/kvp-exp/{sha}")
        if not wt.exists():
            wt.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", mirror, "archive", "--format=tar", sha, "python/sglang/srt"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(wt)], input=archive, check=True)
        cut(wt, sha)


def trees(paths):
    for src in map(Path, paths):
        wt = Path(f"/tmp/kvp-rel/{src.name}")
        if not wt.exists():
            shutil.copytree(src, wt)
        cut(wt, f"rel-{src.name}")


def cut(wt: Path, name: str):
    """Patch `wt` (once) and copy what verify reads to .gpu_payload/<name>/."""
    out = ROOT / ".gpu_payload"
    out.mkdir(exist_ok=True)
    if not (wt / ".kvpatch/state.json").exists():
        # 0 applied; 5 applied with a file skipped elsewhere in the tree (named)
        r = subprocess.run([sys.executable, "-m", "kvpatch", "apply", "--no-commit", str(wt)])
        if r.returncode not in (0, 5):
            raise SystemExit(f"apply failed on {wt} ({r.returncode})")
    state = json.loads((wt / ".kvpatch/state.json").read_text())
    dst = out / name
    if dst.exists():
        shutil.rmtree(dst)
    keep = [f["path"] for f in state["files"]] + [r["path"] for r in state["runtime_files"]]
    for rel in keep:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wt / rel, dst / rel)
    shutil.copytree(wt / ".kvpatch", dst / ".kvpatch")
    print(name, "->", dst, len(keep), "files")


if __name__ == "__main__":
    if sys.argv[1] == "--trees":
        trees(sys.argv[2:])
    else:
        main(sys.argv[1], sys.argv[2:])
