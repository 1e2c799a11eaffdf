"""Build the GPU payload: real SGLang checkouts patched by `kvpatch apply`, cut
down to what `kvpatch verify` reads (the patched backend, its runtime, and
.kvpatch/ with the originals), under .gpu_payload/<sha>/.

.gpu_payload/ is git-ignored (it holds SGLang code, which is never committed);
it travels to the device machine in `carry`.

    python gpu/make_payload.py /work/.mirror/sshleifer+sglang/repo 4ad990ba7 ea8f4e9f3 2e4babdb0
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(mirror: str, shas):
    out = ROOT / ".gpu_payload"
    out.mkdir(exist_ok=True)
    for sha in shas:
        wt = Path(f"/tmp/kvp-wt/{sha}")
        if not wt.exists():
            subprocess.run(["git", "-C", mirror, "worktree", "add", "--detach", str(wt), sha], check=True,
                           capture_output=True)
        if not (wt / ".kvpatch/state.json").exists():
            subprocess.run([sys.executable, "-m", "kvpatch", "apply", "--no-commit", str(wt)], check=True)
        state = json.loads((wt / ".kvpatch/state.json").read_text())
        dst = out / sha
        if dst.exists():
            shutil.rmtree(dst)
        keep = [f["path"] for f in state["files"]] + [r["path"] for r in state["runtime_files"]]
        for rel in keep:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(wt / rel, dst / rel)
        shutil.copytree(wt / ".kvpatch", dst / ".kvpatch")
        print(sha, "->", dst, len(keep), "files")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
