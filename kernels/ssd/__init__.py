"""Mamba-2 SSD (state space duality) kernels: five stages, each file with its backward; the combined autograd
entry; the mixer."""
