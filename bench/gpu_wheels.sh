#!/usr/bin/env bash
# Fetches the wheels that the GPU machine's image lacks (it has torch, numpy, safetensors,
# xxhash, fsspec, rich, typer, pytest, but no package registry) into .whl/ (ignored by git),
# for CPython 3.12 on manylinux x86-64. docs/PERFORMANCE.md, "On a GPU", gives the call
# that carries them and installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
for pkg in "crc32c>=2.4" "isal>=1.6" "zfec>=1.5"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" -d .whl "$pkg"
done
ls -l .whl
