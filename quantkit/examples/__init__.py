"""``demo`` and ``synth``: synthetic checkpoints, the real SmolLM2, the demo release."""
