"""Bytes: where a checkpoint is read and written, its manifest, families, config."""
