"""The engine versions every engine fact here was read in (their wheels, which the tests run)."""

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"
