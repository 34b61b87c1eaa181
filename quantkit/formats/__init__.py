"""Meaning: decoding, quantizing and packing weights; recipes and compressed-tensors configs."""
