"""ssdiff's own Triton kernels (see kernels/README.md).

Importing this package chooses the runtime first (harness.runtime.configure(): the Triton interpreter when
there is no GPU, and its patches), because TRITON_INTERPRET must be set before a kernel is decorated.
"""

try:
    from harness import runtime as _runtime
except ImportError:  # kernels used without the harness
    _runtime = None
if _runtime is not None:
    _runtime.configure()

from kernels import _interpreter_compat  # noqa: E402

_interpreter_compat.apply()
