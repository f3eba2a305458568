"""The fused Mamba-2 mixer entry (mamba_split_conv1d_scan_combined semantics) on top of ssdiff's SSD kernels.

    zxbcdt -> [SwiGLU branch (2*d_nonssm), z (dim), xBC (dim + 2*g*n), dt (h)]
    xBC -> causal depthwise conv1d (taps never cross a seq_idx boundary) -> activation -> x, B, C
    SSD (Triton: ssd_chunk_scan_combined; z gates inside it when there is no rmsnorm_weight)
    -> gated RMSNorm per group of dim // ngroups channels (norm_before_gate either way)
    -> [silu(first) * second, y] -> out_proj

The conv1d, the gated RMSNorm and out_proj are plain torch (autograd), as the issue allows: the Triton work
is the scan.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .combined import ssd_chunk_scan_combined


def causal_conv1d(xBC, weight, bias, seq_idx=None, activation="silu"):
    """Depthwise causal conv1d over time. xBC (b, L, ch); weight (ch, W); a tap reading token s for token t
    counts only when seq_idx[s] == seq_idx[t]. Accumulated in float32, returned in xBC's dtype."""
    b, L, ch = xBC.shape
    W = weight.shape[1]
    dtype = xBC.dtype
    xBC, weight = xBC.float(), weight.float()          # accumulate in fp32, store in the input dtype
    out = xBC.new_zeros(b, L, ch) + (bias.float() if bias is not None else 0)
    for back in range(min(W, L)):                      # tap reading ``back`` tokens earlier
        src = F.pad(xBC, (0, 0, back, 0))[:, :L]
        term = src * weight[:, W - 1 - back]
        if seq_idx is not None and back:
            same = F.pad(seq_idx, (back, 0), value=-2)[:, :L] == seq_idx
            term = term * same[..., None].to(term.dtype)
        out = out + term
    if activation == "silu":
        out = F.silu(out)
    elif activation not in (None, "identity"):
        raise ValueError(f"activation: expected 'silu' or 'identity', got {activation!r}")
    return out.to(dtype)


def gated_rmsnorm(y, z, weight, group_size, eps=1e-6, norm_before_gate=True):
    """RMSNorm over groups of ``group_size`` channels, gated by silu(z) before or after. Computed in fp32,
    returned in y's dtype."""
    dtype = y.dtype
    y, z = y.float(), z.float()
    gate = F.silu(z)
    v = y if norm_before_gate else y * gate
    grouped = v.unflatten(-1, (-1, group_size))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    out = normed * gate if norm_before_gate else normed
    return out.to(dtype)


def ssd_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                   initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                   return_final_states=False, activation="silu", rmsnorm_weight=None,
                                   rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                   ngroups=1, norm_before_gate=True, return_stages=False):
    """Same arguments and returns as mamba_split_conv1d_scan_combined.

    zxbcdt (b, L, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads); conv1d_weight (dim + 2*g*n, width);
    conv1d_bias (dim + 2*g*n,); dt_bias, A (nheads,); D (nheads,) or (nheads, headdim).
    Returns out (b, L, out_dim or d_nonssm + dim), and final_states (b, h, p, n) float32 when asked.
    ``return_stages``: also a dict with "conv" and "normed" (for localization)."""
    b, L, width = zxbcdt.shape
    nheads = A.shape[0]
    if headdim is None:
        headdim = D.shape[1] if D.dim() == 2 else None
    if headdim is None:
        raise ValueError("headdim is needed when D is per head")
    dim = nheads * headdim
    conv_ch = conv1d_weight.shape[0]
    dstate = (conv_ch - dim) // (2 * ngroups)
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads != width:
        raise ValueError(f"zxbcdt width {width} does not split as 2*d_nonssm + 2*dim + 2*g*n + h")
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d(xBC, conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.unflatten(-1, (nheads, headdim))
    B = B.unflatten(-1, (ngroups, dstate))
    C = C.unflatten(-1, (ngroups, dstate))
    z_heads = z.unflatten(-1, (nheads, headdim))
    res = ssd_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D,
                                  z=None if rmsnorm_weight is not None else z_heads, dt_bias=dt_bias,
                                  initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
                                  dt_limit=dt_limit, return_final_states=return_final_states)
    y, final = (res if return_final_states else (res, None))
    y = y.flatten(-2)
    if rmsnorm_weight is not None:
        y = gated_rmsnorm(y, z, rmsnorm_weight, dim // ngroups, rmsnorm_eps, norm_before_gate)
    if d_nonssm:
        first, second = zx0.split(d_nonssm, dim=-1)
        y = torch.cat([F.silu(first) * second, y], dim=-1)
    normed = y
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    out = (y, final) if return_final_states else y
    if return_stages:
        stages = {"conv": xBC}
        if rmsnorm_weight is not None or d_nonssm:
            stages["normed"] = normed
        return out, stages, (x, dt, B, C, z_heads if rmsnorm_weight is None else None)
    return out
