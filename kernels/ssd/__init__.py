"""Mamba-2 SSD (state space duality) kernels: stages, backward, combined autograd entry, mixer."""
