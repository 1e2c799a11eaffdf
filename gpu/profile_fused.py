"""One fused-kernel shape to profile under ncu (gpu/run_all.sh step `profile`).

    ncu --clock-control none -k regex:_fused_split --launch-skip 3 --launch-count 1 \
        python3 gpu/profile_fused.py '{"block_n": 32, "maxnreg": 168}'
    python3 gpu/profile_fused.py '{"wgmma": true}' 128     # 128 heads, the large bucket
    python3 gpu/profile_fused.py '{"gluon": true}' 16      # the 16-row Gluon kernel (step profile_gluon)

32 x 4k rows at 16 heads on a 495,552-slot pool (the issue-17 shape that sets the target);
the JSON argument overrides the launch configuration of the bucket (small at 16 heads); a
second argument sets the heads.
"""

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_fused import batch  # noqa: E402
from bench_attention import load_runtime, make_pool  # noqa: E402

cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
gen = torch.Generator(device="cuda").manual_seed(0)
fz = load_runtime()
pool = make_pool(495552, gen)
heads = int(sys.argv[2]) if len(sys.argv) > 2 else 16
bucket = "small" if heads <= 16 else "large"
b = batch(pool.shape[0], 32, 4096, heads, 1, gen)
out = torch.empty((32, heads, 512), dtype=torch.bfloat16, device="cuda")
for _ in range(5):
    fz.fused_mla(b["q_nope"], b["q_pe"], pool, out, 1.0 / math.sqrt(192), kv_indptr=b["kv_indptr"],
                 kv_indices=b["perm"], config={**fz.FUSED_TUNING[bucket], "gluon": False, **cfg})
torch.cuda.synchronize()
print("profiled", cfg)
