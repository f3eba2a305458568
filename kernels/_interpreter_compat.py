"""One compatibility patch for the Triton interpreter (TRITON_INTERPRET=1), applied only there.

Triton 3.6's interpreter turns integer kernel arguments into 1-element numpy arrays and converts them back
with ``int(array)``, which numpy >= 2.3 refuses for arrays with ndim > 0 ("only 0-dimensional arrays can be
converted to Python scalars"). Every ``for k in range(0, N, BK)`` with a runtime bound therefore fails in the
interpreter (mamba_ssm's kernels too). The patch makes ``__index__`` take the single element. Compiled
kernels are unaffected. This belongs in harness/runtime.py's interpreter patches; it lives here so the
kernels also run when imported on their own.
"""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_ssdiff_patch", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    _patch_lang_tensor._ssdiff_patch = True
    interp._patch_lang_tensor = _patch_lang_tensor
