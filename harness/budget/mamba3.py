"""The same-precision model of the Mamba-3 SISO scan (the mamba3 entry; harness/truth/README.md, "Mamba-3"): the
chunked order of mamba3_siso_combined's forward and the step function's arithmetic, computed in float32 the way
those kernels compute, each rounding point as `ssdiff.budget.rounding.Rounding` says.

- the angle cumsum in float32, ``pi tanh(angles) dt`` summed within a chunk onto the carried angle, reduced mod 2 pi
  at every chunk (as the angle kernel keeps it);
- q + q_bias and k + k_bias in float32, rotated; the rotated q and the rotated k times its scale (dt lambda plus the
  next token's dt (1 - lambda)) rounded as matrix-product operands (the forward stores them in the input dtype and
  reloads them for its dots), and so are the masked q k^T scores before their product with v, the carried state
  before its product with q, and v times its decay to the chunk end before the state update; the diagonal term
  dt lambda (q + q_bias).(k + k_bias) in float32 from the unrotated vectors; decays as differences of the chunk's
  cumsum of adt, as the kernel takes them;
- y stored in the case dtype after the D skip and the z gate; the final SSM state and K state kept in float32;
- the steps of ``mamba3_steps``: the step function's float32 update ``S alpha + beta v_-1 k_-1^T + gamma v k^T``,
  and ``y = S q`` with both operands rounded as matrix-product operands;
- `layer`, the Mamba3 module (the mamba3_layer entry) around that scan: in_proj as torch's ``F.linear`` on the
  stored u and weight, its output stored in the case dtype; ``dt = softplus(dd_dt + dt_bias)``, ``A`` and ``A dt``
  in float32; the B/C norms in float32, the normalized value a rounding point, stored in the case dtype (the norm
  kernel's output); with ``layer_steps`` the K state the module's cache holds between steps in the case dtype
  (its in_proj's); the output norm per head as `ssdiff.budget.model.norm`, stored; out_proj as ``F.linear``.

Backward runs through the same graph in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdiff.budget.model import linear, norm
from ssdiff.budget.rounding import Rounding, over_rows
from ssdiff.model.case import Case

TWO_PI = 2 * math.pi


def _rotation(x, theta):
    """x (..., n), pairs (2j, 2j + 1) for j < a rotated by theta (..., a) in float32 (cos and sin per element)."""
    a = theta.shape[-1]
    pairs = x.unflatten(-1, (-1, 2))
    c, s = torch.cos(theta), torch.sin(theta)
    even, odd = pairs[..., :a, 0], pairs[..., :a, 1]
    turned = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1)
    return torch.cat([turned, pairs[..., a:, :]], dim=-2).flatten(-2)


def _prefill(t, r, lo, hi, states, qb, kb, case: Case, rounding: Rounding):
    """Tokens [lo, hi) of row ``r`` in chunks from ``states`` (theta, S, k, v): (y (T, h, p) before D and z, the
    states after them)."""
    dot, keep = rounding.dot, rounding.keep
    h = t["v"].shape[2]
    rep = h // t["q"].shape[2]
    theta, S, k0, v0 = states
    dt, adt = t["dt"][r, lo:hi], t["adt"][r, lo:hi]                                   # (T, h)
    lam = torch.sigmoid(t["trap"][r, lo:hi])
    gamma = keep(dt * lam)
    shifted = torch.cat([keep(dt[1:] * (1 - lam[1:])), dt.new_zeros(1, h)])
    scale = keep(gamma + shifted)
    qp = keep(t["q"][r, lo:hi].repeat_interleave(rep, dim=1) + qb)                  # (T, h, n)
    kp = keep(t["k"][r, lo:hi].repeat_interleave(rep, dim=1) + kb)
    diag = keep(gamma * (qp * kp).sum(-1))                                           # (T, h)
    S = keep(S + (dt[0] * (1 - lam[0]))[:, None, None] * v0[:, :, None] * k0[:, None, :])
    ys, T = [], hi - lo
    for c0 in range(0, T, case.chunk_size):
        c1 = min(T, c0 + case.chunk_size)
        rate = keep(math.pi * torch.tanh(t["angles"][r, lo + c0:lo + c1]) * dt[c0:c1, :, None])
        angle = torch.remainder(keep(theta + torch.cumsum(rate, dim=0)), TWO_PI)     # (Q, h, a)
        theta = torch.remainder(keep(theta + rate.sum(0)), TWO_PI)
        q = dot(_rotation(qp[c0:c1], angle))
        k_rot = keep(_rotation(kp[c0:c1], angle))
        k = dot(k_rot * scale[c0:c1, :, None])
        v = t["v"][r, lo + c0:lo + c1]
        cs = torch.cumsum(adt[c0:c1], dim=0)                                         # (Q, h)
        gap = (cs[:, None, :] - cs[None, :, :]).clamp(max=0.0)                       # (i, j, h)
        below = torch.tril(torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=v.device), diagonal=-1)
        scores = torch.einsum("ihn,jhn->ijh", q, k) * rounding.decay(gap)
        scores = dot(torch.where(below[:, :, None], scores, torch.zeros_like(scores)))
        y = keep(torch.einsum("ijh,jhp->ihp", scores, v)
                 + torch.einsum("ihn,hpn->ihp", q, dot(S)) * rounding.decay(cs)[:, :, None])
        ys.append(keep(y + diag[c0:c1, :, None] * v))
        last = cs[-1]
        carried = dot(v * rounding.decay(last[None] - cs)[:, :, None])
        S = keep(S * rounding.decay(last)[:, None, None] + torch.einsum("jhp,jhn->hpn", carried, k))
    return torch.cat(ys, dim=0), (theta, S, k_rot[-1], t["v"][r, hi - 1])


def _steps(t, r, lo, hi, states, qb, kb, rounding: Rounding, store_k: bool = False):
    """Tokens [lo, hi) of row ``r`` one step each, as the step function computes them; ``store_k``: the K state
    held between steps in the case dtype (`Rounding.store`), else in float32."""
    dot, keep = rounding.dot, rounding.keep
    h = t["v"].shape[2]
    rep = h // t["q"].shape[2]
    theta, S, k_prev, v_prev = states
    hold = rounding.store if store_k else (lambda k: k)
    k_prev = hold(k_prev)
    ys = []
    for i in range(lo, hi):
        dt = t["dt"][r, i]
        theta = torch.remainder(keep(theta + keep(torch.tanh(t["angles"][r, i]) * math.pi * dt[:, None])), TWO_PI)
        q = keep(_rotation(keep(t["q"][r, i].repeat_interleave(rep, dim=0) + qb), theta))
        k = keep(_rotation(keep(t["k"][r, i].repeat_interleave(rep, dim=0) + kb), theta))
        v = t["v"][r, i]
        lam = torch.sigmoid(t["trap"][r, i])
        alpha = rounding.decay(t["adt"][r, i])
        beta, gamma = keep(alpha * dt * (1 - lam)), keep(lam * dt)
        S = keep(S * alpha[:, None, None] + (beta[:, None] * v_prev)[:, :, None] * k_prev[:, None, :]
                 + (gamma[:, None] * v)[:, :, None] * k[:, None, :])
        ys.append(keep(torch.einsum("hpn,hn->hp", dot(S), dot(q))))
        k_prev, v_prev = hold(k), v
    return torch.stack(ys), (theta, S, k_prev, v_prev)


def scan(t: dict, case: Case, rounding: Rounding, folds: int = 0, store_k: bool = False):
    """The model on float32 tensors ``t`` (the case's inputs, rows folded as ``folds`` says: `evaluate_folded`):
    y (rows, L, h, p) stored in the case dtype, and the four final states (sequences of every row, in order).
    ``store_k``: as `_steps`."""
    v = t["v"]
    R, L, h, p = v.shape
    n, a = t["q"].shape[3], t["angles"].shape[3]
    qb, kb, D = (over_rows(t.get(name), folds, R) for name in ("q_bias", "k_bias", "D"))
    one = lambda x, r: x if not folds else x[r]                                      # noqa: E731
    if case.segments is not None:
        bounds = [0]
        for length in case.segments[0]:
            bounds.append(bounds[-1] + length)
    else:
        bounds = [0, L]
    nseq = len(bounds) - 1
    prefill = L - case.mamba3_steps
    ys, finals = [], []
    for r in range(R):
        rnd = rounding.fold(r // (R // folds)) if folds else rounding     # a row's rounding points: its fold's signs
        pieces = []
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            s = r * nseq + j
            if case.initial_states:
                states = (t["init_angle"][s], t["initial_states"][s], t["init_k"][s], t["init_v"][s])
            else:
                states = (v.new_zeros(h, a), v.new_zeros(h, p, n), v.new_zeros(h, n), v.new_zeros(h, p))
            mid = max(lo, min(hi, prefill))
            if mid > lo:
                y, states = _prefill(t, r, lo, mid, states, one(qb, r), one(kb, r), case, rnd)
                pieces.append(y)
            if hi > mid:
                y, states = _steps(t, r, mid, hi, states, one(qb, r), one(kb, r), rnd, store_k)
                pieces.append(y)
            finals.append(states)
        y = torch.cat(pieces, dim=0)
        if D is not None:
            y = rnd.keep(y + one(D, r)[:, None] * v[r])
        if "z" in t:
            y = y * F.silu(t["z"][r])
        ys.append(y)
    y = rounding.store(torch.stack(ys))
    names = ("final_angle", "final_states", "final_k", "final_v")
    return y, {name: rounding.keep(torch.stack(parts)) for name, parts in zip(names, zip(*finals))}


A_FLOOR = 1e-4          # Mamba3's A_floor (harness/truth/mamba3_layer.py)


def _bc_norm(x, weight, eps, rounding: Rounding):
    """A B/C norm (over d_state) as mamba_ssm's norm kernel computes it: float32, stored in the case dtype."""
    normalized = rounding.keep(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return rounding.store(normalized * weight)


def layer(t: dict, case: Case, rounding: Rounding, folds: int = 0):
    """The Mamba3 module on float32 tensors ``t`` (a mamba3_layer case's inputs, folded as for `scan`): y (rows, L,
    d_model), before it is stored."""
    h, p, g, n, a = case.nheads, case.headdim, case.ngroups, case.dstate, case.rope_angles
    u = t["u"]
    R, L = u.shape[:2]
    keep, store = rounding.keep, rounding.store
    zx = store(linear(rounding.linear_operand(u), rounding.linear_operand(t["in_proj_weight"]), None, folds))
    z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(zx, [h * p, h * p, g * n, g * n, h, h, h, a], dim=-1)
    dt = keep(F.softplus(dd_dt + over_rows(t["dt_bias"], folds, R, lead=1)))
    A = keep(torch.clamp(-F.softplus(dd_A), max=-A_FLOOR))
    lead = lambda w: over_rows(w, folds, R, lead=2)                      # noqa: E731  (b, L, g, n) operands
    scan_t = dict(q=_bc_norm(C.unflatten(-1, (g, n)), lead(t["q_norm_weight"]), case.rmsnorm_eps, rounding),
                  k=_bc_norm(B.unflatten(-1, (g, n)), lead(t["k_norm_weight"]), case.rmsnorm_eps, rounding),
                  v=x.unflatten(-1, (h, p)), dt=dt, adt=keep(A * dt), trap=trap, q_bias=t["q_bias"],
                  k_bias=t["k_bias"], angles=angles[:, :, None, :].expand(-1, -1, h, -1), D=t["D"])
    zh = z.unflatten(-1, (h, p))
    if not case.rmsnorm:
        scan_t["z"] = zh
    y, _ = scan(scan_t, case.mamba3_scan, rounding, folds, store_k=bool(case.layer_steps))
    y = y.flatten(-2)
    if case.rmsnorm:
        y = store(norm(y, z, over_rows(t["rmsnorm_weight"], folds, R, lead=1), h, case.rmsnorm_eps, True, rounding))
    return linear(rounding.linear_operand(y), rounding.linear_operand(t["outproj_weight"]), None, folds)
