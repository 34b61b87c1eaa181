"""Built-in gate suites, installed as quantkit.suites (see quantkit/packaged.py)."""
