"""Parallel attention: the ring over a mesh axis, its layouts and pieces."""
