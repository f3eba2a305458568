"""ssdiff's own Triton kernels (see kernels/README.md).

Without a GPU the kernels run under the Triton interpreter, which must be chosen before this package is
imported (``triton.jit`` reads TRITON_INTERPRET=1 when it decorates a kernel) and needs a patch on recent
numpy; ``ssdiff.runtime.configure()`` does both.
"""
