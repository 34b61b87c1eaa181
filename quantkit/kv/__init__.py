"""``calibrate-kv``: observing what the engines cache, FP8 KV scales, FP8 KV emulation."""
