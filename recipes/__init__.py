"""Built-in recipes, installed as quantkit.recipes (see quantkit/packaged.py)."""
