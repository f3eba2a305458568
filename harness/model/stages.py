"""The pipeline's stages: one record each, in pipeline order — its name, what it is in words, and the axes of its
tensor in the layout every implementation's stage is converted into (the oracle's).

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

A channel axis's parts (which head or group each channel belongs to) depend on the case: ssdiff.model.axes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """name: what verdicts, stage maps and capabilities call it; words: what it is ("the gated RMSNorm"); axes:
    one label per dimension of its tensor (ssdiff.model.axes' labels; y's depend on the entry point)."""

    name: str
    words: str
    axes: tuple


STAGES = (
    Stage("in_proj", "the input projection (in_proj)", ("batch", "token", "channel")),
    Stage("conv", "the causal conv1d", ("batch", "token", "channel")),
    Stage("dt", "dt processing (bias, softplus, limits)", ("batch", "token", "head")),
    Stage("dA_cumsum", "the dA cumsum", ("batch", "token", "head")),
    Stage("chunk_states", "the per-chunk states", ("batch", "chunk", "head", "p", "n")),
    Stage("passed_states", "state passing between chunks", ("batch", "chunk", "head", "p", "n")),
    Stage("CB", "C.B^T per chunk", ("batch", "chunk", "group", "i", "j")),
    Stage("scan", "the chunk scan output", ("batch", "token", "head", "p")),
    Stage("skip", "the D skip", ("batch", "token", "head", "p")),
    Stage("gated", "the z gate", ("batch", "token", "head", "p")),
    Stage("normed", "the gated RMSNorm", ("batch", "token", "channel")),
    Stage("y", "the output projection", ()),
)
BY_NAME = {s.name: s for s in STAGES}
STAGE_ORDER = tuple(BY_NAME)


def words(name: str) -> str:
    """What stage ``name`` is, in words (the name itself for one that is not a stage)."""
    return BY_NAME[name].words if name in BY_NAME else name


__all__ = ["Stage", "STAGES", "BY_NAME", "STAGE_ORDER", "words"]
