"""The CLI's commands, one module per group; quantkit/cli.py registers them on its app."""
