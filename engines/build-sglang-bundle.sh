#!/usr/bin/env bash
# Builds a tar.xz of SGLang 0.5.17 and what it needs beyond a CUDA 13 / torch 2.11 machine's packages, small enough
# to carry to a machine with no network (about 54 MB), every file checked against the sha256 its list pins.
# Usage: engines/build-sglang-bundle.sh OUT.tar.xz [LIST]
# LIST (default engines/sglang-gpu-wheels.txt) may name another set, e.g. engines/eval-client-gpu-wheels.txt (4 MB), the
# client `quantkit eval --engine sglang` runs there; unpack both into the same site.
# There: mkdir site && tar -C site -xJf OUT.tar.xz, then PYTHONPATH=site (first: it shadows the machine's transformers
# 5.17, whose import of sglang fails) and the flags of ../shared/engines/README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(realpath "$1")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do platforms+=(--platform "$p"); done
list="$(realpath "${2:-$here/sglang-gpu-wheels.txt}")"
grep -v '^#' "$list" | sed '/^$/d' > "$work/req.txt"
# the few distributions PyPI has only as sources are pure Python: built into wheels here
sdists="$(sed -n '/^# sdists only/,$p' "$list" | grep -v '^#' | sed '/^$/d' || true)"
grep -vxF -f <(printf '%s\n' "$sdists") "$work/req.txt" > "$work/binary.txt" || true
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$work/wheels" -r "$work/binary.txt"
if [ -n "$sdists" ]; then
  printf '%s\n' "$sdists" > "$work/sdist.txt"
  python3 -m pip wheel -q --no-deps -w "$work/wheels" -r "$work/sdist.txt"
fi
mkdir "$work/site"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
# What an H200 serving with the triton attention backend never loads: FlashAttention 3, Blackwell kernels,
# FlashMLA and InfLLM ops, xgrammar's native library (--grammar-backend none), tests, benchmarks, multimodal generation.
cd "$work/site"
rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sgl_kernel/infllm_ops* sgl_kernel/flashmla_ops* xgrammar/lib \
  sglang/test sglang/multimodal_gen sglang/benchmark tools
tar --sort=name -cf - . | xz -6 -T2 > "$out"
ls -l "$out"
