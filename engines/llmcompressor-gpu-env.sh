# Source on the GPU machine, in the repository's root, after engines/sglang-gpu-env.sh:
#   . engines/llmcompressor-gpu-env.sh [WHEELS] [SITE]
# The gpu-marked tests and benchmarks that run llm-compressor or auto-round beside quantkit (tests/test_gpu.py's
# equality tests, tests/test_signround.py's GPU test, benchmarks/int4_quality.py) need both, which the SGLang bundle
# does not hold, and the machine's own transformers, which the bundle's shadows. SITE (default /tmp/lc-site) links
# every package of the SGLang site but transformers and tokenizers, and unpacks the wheels in WHEELS (default
# .gpu/lc: `pip download --no-deps llmcompressor==0.14.0.1 auto-round==0.15.1 -d .gpu/lc`, 1.7 MB) into it.
wheels="${1:-.gpu/lc}"
site="${2:-/tmp/lc-site}"
sglang_site="${QUANTKIT_SGLANG_SITE:-/tmp/sglang-site}"
if [ ! -d "$site/llmcompressor" ]; then
  mkdir -p "$site" || return 1
  for entry in "$sglang_site"/*; do
    case "$(basename "$entry")" in
      transformers|transformers-*|tokenizers|tokenizers-*) ;;
      *) ln -sfn "$entry" "$site/" ;;
    esac
  done
  for wheel in "$wheels"/*.whl; do
    python3 -m zipfile -e "$wheel" "$site/" || return 1
  done
fi
export PYTHONPATH="$site:$PWD"
