"""Kernels: XLA (blocked) and Pallas backends and what they share."""
