"""Shared machinery of the ops: arrays in, checks, plan cache, NVRTC and the kernel cache, launches."""
