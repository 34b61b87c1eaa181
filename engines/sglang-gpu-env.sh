# Source on the GPU machine, in the repository's root: . engines/sglang-gpu-env.sh BUNDLE.tar.xz [SITE]
# Unpacks the bundle of engines/build-sglang-bundle.sh into SITE (default /tmp/sglang-site) unless it is there (and
# .gpu/eval-client.tar.xz beside it, the client `quantkit eval` runs: engines/eval-client-gpu-wheels.txt), and sets
# what SGLang 0.5.17 needs there (../shared/engines/README.md): its site first on PYTHONPATH (it shadows the machine's
# transformers, whose import of sglang fails), CUDA_HOME and nvrtc for the kernels it compiles on first use, ninja on
# PATH, no hub, and QUANTKIT_SGLANG_SITE for tests/test_sglang_gpu.py.
bundle="$1"
site="${2:-/tmp/sglang-site}"
if [ ! -d "$site/sglang" ]; then
  mkdir -p "$site" && tar -C "$site" -xJf "$bundle" || return 1
fi
if [ -f .gpu/eval-client.tar.xz ] && [ ! -d "$site/lm_eval" ]; then
  tar -C "$site" -xJf .gpu/eval-client.tar.xz || return 1
fi
# quantkit runs from this checkout (PYTHONPATH): its recipes and suites sit where an install puts them (pyproject's
# package-dir); ignored by git
ln -sfn ../recipes quantkit/recipes && ln -sfn ../eval/suites quantkit/suites
nvcc="$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)"
export CUDA_HOME="$(dirname "$(dirname "$nvcc")")"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export PYTHONPATH="$site:$PWD"
export HF_HUB_OFFLINE=1
export TVM_FFI_CACHE_DIR="${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi-cache}"
export QUANTKIT_SGLANG_SITE="$site"
# the kernels an earlier start compiled (SGLang's JIT kernels and Triton's; 5-8 minutes on a fresh machine), where a
# run brought them back: tar -C / -cJf gpu-caches.tar.xz tmp/tvm-ffi-cache root/.triton
if [ -f .gpu/gpu-caches.tar.xz ] && [ ! -d "$TVM_FFI_CACHE_DIR" ]; then
  tar -C / -xJf .gpu/gpu-caches.tar.xz
fi
