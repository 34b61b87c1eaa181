"""quantkit: offline quantization and checkpoint conversion for giant MoE LLMs.

Each user action is one function; heavy libraries are imported only where used so that
``quantkit --help`` and the start of real work stay fast.
"""

__version__ = "0.1.0"
