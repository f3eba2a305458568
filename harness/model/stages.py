"""The names and order of the pipeline stages, and their layouts.

Stage tensors use one layout for every implementation (adapters convert theirs into it):

    in_proj        (b, L, zxbcdt width)  the layer's in_proj output, zxbcdt (layer only)
    conv           (b, L, dim + 2*g*n)   xBC after the causal conv1d and its activation (split_conv1d only)
    dt             (b, L, h)             dt after bias, softplus and dt_limit
    dA_cumsum      (b, L, h)             cumulative sum of dt*A inside each chunk
    chunk_states   (b, c, h, p, n)       each chunk's own end state, from zero at the chunk start
    passed_states  (b, c, h, p, n)       the state entering each chunk (chunk 0: initial_states or zeros)
    CB             (b, c, g, Q, Q)       C_i . B_j of each chunk and group (zero past L)
    scan           (b, L, h, p)          the scan output before the D skip
    skip           (b, L, h, p)          after the D skip
    gated          (b, L, h, p)          after z gating (when z gates inside the scan)
    normed         (b, L, d_nonssm+dim)  after the gated RMSNorm (and the SwiGLU branch), before out_proj
    y              the output (the layer's: after out_proj, (b, L, d_model))
"""

from __future__ import annotations

STAGE_ORDER = ("in_proj", "conv", "dt", "dA_cumsum", "chunk_states", "passed_states", "CB", "scan", "skip", "gated",
               "normed", "y")
