"""The fused Mamba-2 mixer (mamba_split_conv1d_scan_combined semantics) around any oracle scan, in float64.

    zxbcdt -> [SwiGLU branch (2*d_nonssm), z (dim), xBC (dim + 2*g*n), dt (h)]
    xBC -> causal depthwise conv1d (respects seq_idx) -> activation -> x, B, C
    scan(x, dt, A, B, C, D, dt_bias, softplus, dt_limit, initial_states, seq_idx; z gates here iff no rmsnorm)
    -> gated RMSNorm over groups of dim // ngroups channels (norm_before_gate either way)
    -> [SwiGLU branch, y] -> out_proj

The mixer pieces come in two independent styles so the oracles cross-check them too: "loop" (per tap, per
group, used by the recurrent oracle) and "vectorized" (conv1d / reshape, used by the other two).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdiff.model.evaluation import Evaluation


# ---- loop style ------------------------------------------------------------------------------------------

def conv_loop(xBC, weight, bias, seq, activation):
    """out[t] = bias + sum_k weight[:, k] * xBC[t - (W-1) + k], over taps inside t's sequence."""
    b, L, ch = xBC.shape
    W = weight.shape[1]
    rows = []
    for t in range(L):
        acc = bias.expand(b, ch)
        for k in range(W):
            s = t - (W - 1) + k
            if s < 0:
                continue
            inside = (seq[:, s] == seq[:, t]).to(xBC.dtype)[:, None]          # (b, 1)
            acc = acc + weight[:, k] * xBC[:, s] * inside
        rows.append(acc)
    out = torch.stack(rows, dim=1)
    return out * torch.sigmoid(out) if activation == "silu" else out


def norm_loop(y, z, weight, ngroups, eps, norm_before_gate):
    """Gated RMSNorm, one channel group at a time."""
    size = y.shape[-1] // ngroups
    gate = z * torch.sigmoid(z)
    v = y if norm_before_gate else y * gate
    pieces = []
    for k in range(ngroups):
        part = v[..., k * size:(k + 1) * size]
        rstd = 1.0 / torch.sqrt((part * part).sum(-1, keepdim=True) / size + eps)
        pieces.append(part * rstd)
    out = torch.cat(pieces, dim=-1) * weight
    return out * gate if norm_before_gate else out


# ---- vectorized style ------------------------------------------------------------------------------------

def conv_vectorized(xBC, weight, bias, seq, activation):
    """Depthwise causal conv1d per tap shift, masked where the shifted token is in another sequence."""
    b, L, ch = xBC.shape
    W = weight.shape[1]
    out = bias.expand(b, L, ch).clone()
    for shift in range(W):                                                     # shift = how far back
        if shift >= L:
            break
        src = F.pad(xBC, (0, 0, shift, 0))[:, :L]
        src_seq = F.pad(seq, (shift, 0), value=-2)[:, :L]
        ok = (src_seq == seq).to(xBC.dtype)[..., None]
        out = out + src * ok * weight[:, W - 1 - shift]
    return F.silu(out) if activation == "silu" else out


def norm_vectorized(y, z, weight, ngroups, eps, norm_before_gate):
    gate = F.silu(z)
    v = y if norm_before_gate else y * gate
    grouped = v.unflatten(-1, (ngroups, -1))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    return normed * gate if norm_before_gate else normed


STYLES = {"loop": (conv_loop, norm_loop), "vectorized": (conv_vectorized, norm_vectorized)}


def mixer(scan, style, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, *, chunk_size, nheads, headdim,
          ngroups, dstate, d_nonssm=0, initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf),
          activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
          norm_before_gate=True) -> Evaluation:
    """zxbcdt (b, L, 2*d_nonssm + 2*dim + 2*g*n + h), float64. ``scan`` is an oracle's scan function."""
    conv, norm = STYLES[style]
    b, L, _ = zxbcdt.shape
    dim = nheads * headdim
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=zxbcdt.device)
    xBC = conv(xBC, conv1d_weight, conv1d_bias, seq, activation)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.unflatten(-1, (nheads, headdim))
    z_heads = z.unflatten(-1, (nheads, headdim))
    res = scan(x, dt, A, B.unflatten(-1, (ngroups, dstate)), C.unflatten(-1, (ngroups, dstate)),
               chunk_size=chunk_size, D=D, z=None if rmsnorm_weight is not None else z_heads, dt_bias=dt_bias,
               dt_softplus=True, dt_limit=dt_limit, initial_states=initial_states, seq_idx=seq_idx)
    stages = {"conv": xBC, **res.stages}
    y = res.outputs["y"].flatten(-2)
    if rmsnorm_weight is not None:
        y = norm(y, z, rmsnorm_weight, ngroups, rmsnorm_eps, norm_before_gate)
    if d_nonssm:
        first, second = zx0.split(d_nonssm, dim=-1)
        y = torch.cat([first * torch.sigmoid(first) * second, y], dim=-1)
    if rmsnorm_weight is not None or d_nonssm:
        stages["normed"] = y
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return Evaluation({**res.outputs, "y": y}, stages=stages)
