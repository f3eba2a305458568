"""The whole Mamba-2 layer in float64: in_proj, then the fused mixer of harness/truth/mixer.py.

    u (b, L, d_model) -> zxbcdt = u @ in_proj_weight^T + in_proj_bias
    A = -exp(A_log)                           (every layer holds A as its log)
    -> mixer(zxbcdt, conv1d, dt_bias, A, D, gated RMSNorm, SwiGLU branch, out_proj)   (harness/truth/mixer.py)

A layer without a conv bias convolves with a zero bias. Stages: "in_proj" (zxbcdt) and the mixer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdiff.model.evaluation import Evaluation
from ssdiff.truth import mixer


def layer(scan, style, u, in_proj_weight, in_proj_bias, conv1d_weight, conv1d_bias, dt_bias, A_log, D,
          rmsnorm_weight, outproj_weight, outproj_bias, *, chunk_size, nheads, headdim, ngroups, dstate,
          d_nonssm=0, seq_idx=None, dt_limit=(0.0, math.inf), rmsnorm_eps=1e-5, norm_before_gate=False) -> Evaluation:
    """u (b, L, d_model), float64 like every weight; ``scan`` an oracle's scan, ``style`` its mixer style.
    Returns y (b, L, d_model) and the stages (in_proj, conv, the scan's, normed)."""
    zxbcdt = F.linear(u, in_proj_weight, in_proj_bias)
    if conv1d_bias is None:
        conv1d_bias = torch.zeros(conv1d_weight.shape[0], dtype=u.dtype, device=u.device)
    res = mixer.mixer(scan, style, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, -torch.exp(A_log), D,
                      chunk_size=chunk_size, nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate,
                      d_nonssm=d_nonssm, seq_idx=seq_idx, dt_limit=dt_limit, activation="silu",
                      rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                      outproj_bias=outproj_bias, norm_before_gate=norm_before_gate)
    return Evaluation({"y": res.outputs["y"]}, stages={"in_proj": zxbcdt, **res.stages})
