"""What the serving engines do, read in their own source (SGLang 0.5.23, vLLM 0.33.0), in one place below every
stage that needs it: versions, how each loader renames tensors (loaders.py), what the INT4 kernels accept
(kernels.py), what the attention backends do with FP8 KV scales (kv_scales.py), and the one SGLang command line
quantkit writes (launch.py)."""
