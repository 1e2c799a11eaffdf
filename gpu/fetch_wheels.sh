#!/usr/bin/env bash
# Download, on this (networked) machine, the wheels that gpu/run_all.sh installs on the device
# machine (no network there; Python 3.12, x86_64): FlashInfer and its tvm-ffi, and kvpatch's
# own dependencies, which the device's image lacks (GPU run 28 lost its tests to a missing
# libcst). Carry the folder: run(..., carry=[".whl", ...]). About 25 MB.
#   bash gpu/fetch_wheels.sh [DIR]   (default .whl)
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --dest "$dir" --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any \
  flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 \
  'libcst>=1.1,<1.10' 'click>=8.1' 'GitPython>=3.1.30' gitdb smmap pyyaml
ls -1 "$dir"
