"""The XLA blocked kernels and their tiling helpers."""
