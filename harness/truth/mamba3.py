"""The float64 truth of the Mamba-3 SISO scan (harness/truth/README.md, "Mamba-3"), in three evaluation orders:

    recurrent   token by token: the exponential-trapezoidal recurrence as its definition
    quadratic   per sequence, y = (W o q k^T) v with the mixing weights W written out in closed form
    chunked     per sequence, chunks of Q tokens with a carried state (the kernels' order)

Each takes the case's float64 tensors (token-major, harness/inputs/drawing.py: q, k (b, L, g, n), v (b, L, h, p),
dt, adt, trap (b, L, h), q_bias, k_bias (h, n), angles (b, L, h, a), D (h,), z like v, and the four input states
init_angle (S, h, a), initial_states (S, h, p, n), init_k (S, h, n), init_v (S, h, p), S the sequences) and
returns y (b, L, h, p) and the four final states: final_angle (mod 2 pi), final_states, final_k, final_v. They
share no code with any kernel; the quadratic and chunked orders share `_rotated` (bias, angle cumsum, rotation),
which the recurrent order computes again token by token.
"""

from __future__ import annotations

import math

import torch

from ssdiff.model.evaluation import Evaluation

STATE_INPUTS = ("init_angle", "initial_states", "init_k", "init_v")
STATE_OUTPUTS = ("final_angle", "final_states", "final_k", "final_v")


def sequences(b: int, L: int, cu_seqlens) -> list:
    """(row, start, end) of every sequence, in the order of the states' leading axis: one per batch row, or, with
    cu_seqlens (a list or tensor of bounds), the sequences of batch row 0."""
    if cu_seqlens is None:
        return [(row, 0, L) for row in range(b)]
    bounds = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    return [(0, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def bounds_of(case):
    """cu_seqlens of a mamba3 case as a list (its segments' bounds), or None."""
    if case.segments is None:
        return None
    out = [0]
    for length in case.segments[0]:
        out.append(out[-1] + length)
    return out


def _initial(t: dict, s: int, h: int, a: int, p: int, n: int):
    """The input states of sequence ``s`` (zeros where the case has none)."""
    zeros = t["v"].new_zeros
    if "initial_states" not in t:
        return zeros(h, a), zeros(h, p, n), zeros(h, n), zeros(h, p)
    return t["init_angle"][s], t["initial_states"][s], t["init_k"][s], t["init_v"][s]


def _finish(t: dict, ys, finals) -> Evaluation:
    y = ys
    if "D" in t:
        y = y + t["D"][:, None] * t["v"]
    if "z" in t:
        y = y * t["z"] * torch.sigmoid(t["z"])
    out = {"y": y}
    for name, parts in zip(STATE_OUTPUTS, zip(*finals)):
        out[name] = torch.stack(parts)
    out["final_angle"] = torch.remainder(out["final_angle"], 2 * math.pi)
    return Evaluation(out)


# ---- the recurrence -------------------------------------------------------------------------------------------

def rotate(x, theta):
    """x (..., n) with its pairs (2j, 2j + 1), j < a, rotated by theta (..., a); the other pairs as they are."""
    a = theta.shape[-1]
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., :a, 0], pairs[..., :a, 1]
    c, s = torch.cos(theta), torch.sin(theta)
    turned = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1)
    return torch.cat([turned, pairs[..., a:, :]], dim=-2).flatten(-2)


def step(t: dict, row: int, i: int, states: tuple, heads) -> tuple:
    """One token ``i`` of batch row ``row`` from the four states (theta, S, k, v): (y before D and z, new states).

        theta_t = theta_t-1 + pi tanh(angles_t) dt_t
        q~_t = R(theta_t)(q_t + q_bias),  k~_t = R(theta_t)(k_t + k_bias)
        S_t = exp(adt_t) S_t-1 + exp(adt_t) dt_t (1 - sigmoid(trap_t)) v_t-1 k~_t-1^T + dt_t sigmoid(trap_t) v_t k~_t^T
        y_t = S_t q~_t

    y_t's own term dt_t sigmoid(trap_t) (k~_t . q~_t) v_t is taken as (k_t + k_bias) . (q_t + q_bias), its exact
    value (one rotation turns both): its gradient with respect to the angle is then exactly zero, not the
    rounding residue of two rotations (which outgrows any absolute tolerance when dt > 20 turns a pair by ~70 rad).
    """
    theta, S, k_prev, v_prev = states
    dt, trap = t["dt"][row, i], torch.sigmoid(t["trap"][row, i])                 # (h,)
    theta = theta + math.pi * torch.tanh(t["angles"][row, i]) * dt[:, None]
    qb, kb = t["q"][row, i][heads] + t["q_bias"], t["k"][row, i][heads] + t["k_bias"]   # (h, n)
    q, k = rotate(qb, theta), rotate(kb, theta)
    v = t["v"][row, i]                                                           # (h, p)
    alpha = torch.exp(t["adt"][row, i])
    beta, gamma = alpha * dt * (1 - trap), dt * trap
    before = alpha[:, None, None] * S + beta[:, None, None] * v_prev[:, :, None] * k_prev[:, None, :]
    y = torch.einsum("hpn,hn->hp", before, q) + (gamma * (qb * kb).sum(-1))[:, None] * v
    S = before + gamma[:, None, None] * v[:, :, None] * k[:, None, :]
    return y, (theta, S, k, v)


def recurrent(t: dict, cu_seqlens=None) -> Evaluation:
    b, L, h, p = t["v"].shape
    g, n, a = t["q"].shape[2], t["q"].shape[3], t["angles"].shape[3]
    heads = [i // (h // g) for i in range(h)]
    ys = [[None] * L for _ in range(b)]
    finals = []
    for s, (row, lo, hi) in enumerate(sequences(b, L, cu_seqlens)):
        states = _initial(t, s, h, a, p, n)
        for i in range(lo, hi):
            ys[row][i], states = step(t, row, i, states, heads)
        finals.append(states)
    y = torch.stack([torch.stack(r) for r in ys])
    return _finish(t, y, finals)


# ---- the vectorized orders ------------------------------------------------------------------------------------

def _rotated(t: dict, row: int, lo: int, hi: int, theta0):
    """q~, k~ (T, h, n) of tokens [lo, hi) of ``row``, theta (T, h, a) from the sequence's initial angle, and each
    token's own q~ . k~ (T, h), taken unrotated (its exact value: see `step`)."""
    h = t["v"].shape[2]
    g = t["q"].shape[2]
    rate = math.pi * torch.tanh(t["angles"][row, lo:hi]) * t["dt"][row, lo:hi, :, None]   # (T, h, a)
    theta = theta0 + torch.cumsum(rate, dim=0)
    rep = h // g
    qb = t["q"][row, lo:hi].repeat_interleave(rep, dim=1) + t["q_bias"]
    kb = t["k"][row, lo:hi].repeat_interleave(rep, dim=1) + t["k_bias"]
    return _turn(qb, theta), _turn(kb, theta), theta, (qb * kb).sum(-1)


def _turn(x, theta):
    """x (T, h, n) rotated pairwise, written with a complex product (another form than `rotate`'s)."""
    a = theta.shape[-1]
    head, tail = x[..., :2 * a], x[..., 2 * a:]
    z = torch.view_as_complex(head.unflatten(-1, (a, 2)).contiguous()) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([torch.view_as_real(z).flatten(-2), tail], dim=-1)


def _weights(t: dict, row: int, lo: int, hi: int, v0, k0):
    """(gamma (T, h), scale (T, h): the weight of token s's v k^T in every later state, and the carried-in term
    dt_lo (1 - sigmoid(trap_lo)) v_-1 k_-1^T (h, p, n) of the sequence's first token)."""
    dt, trap = t["dt"][row, lo:hi], torch.sigmoid(t["trap"][row, lo:hi])
    gamma = dt * trap
    shifted = torch.cat([dt[1:] * (1 - trap[1:]), dt.new_zeros(1, dt.shape[1])])
    carried = (dt[0] * (1 - trap[0]))[:, None, None] * v0[:, :, None] * k0[:, None, :]
    return gamma, gamma + shifted, carried


def _segsum(adt):
    """seg[i, j] = sum of adt over (j, i] for j <= i, -inf above the diagonal: (h, T, T), a direct sum."""
    T = adt.shape[0]
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=adt.device), diagonal=-1)
    terms = torch.where(below[None], adt.T[:, :, None].expand(-1, T, T), torch.zeros((), dtype=adt.dtype,
                                                                                      device=adt.device))
    seg = torch.cumsum(terms, dim=1)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=adt.device))
    return torch.where(causal[None], seg, torch.full_like(seg, -math.inf))


def _by_sequence(t: dict, cu_seqlens, body) -> Evaluation:
    """A vectorized order: for each sequence, ``body(q~, k~, v, adt, scale, start)`` (start: the state entering the
    sequence with its first token's carried-in term, (h, p, n)) -> (the y of its tokens (T, h, p) from the earlier
    tokens and the start, its final SSM state); each token's own term gamma (q~ . k~) v added, the rows' y put
    together in token order."""
    b, L, h, p = t["v"].shape
    n, a = t["q"].shape[3], t["angles"].shape[3]
    rows = [[] for _ in range(b)]
    finals = []
    for s, (row, lo, hi) in enumerate(sequences(b, L, cu_seqlens)):
        theta0, S0, k0, v0 = _initial(t, s, h, a, p, n)
        if hi == lo:                                        # an empty sequence hands on its input states
            finals.append((theta0, S0, k0, v0))
            continue
        q, k, theta, own = _rotated(t, row, lo, hi, theta0)
        gamma, scale, carried = _weights(t, row, lo, hi, v0, k0)
        v = t["v"][row, lo:hi]
        part, S = body(q, k, v, t["adt"][row, lo:hi], scale, S0 + carried)
        rows[row].append((lo, part + (gamma * own)[:, :, None] * v))
        finals.append((theta[-1], S, k[-1], v[-1]))
    y = torch.stack([torch.cat([part for _, part in sorted(parts, key=lambda item: item[0])], dim=0)
                     for parts in rows])
    return _finish(t, y, finals)


def quadratic(t: dict, cu_seqlens=None) -> Evaluation:
    def body(q, k, v, adt, scale, start):
        seg = _segsum(adt)                                                        # (h, T, T)
        T = adt.shape[0]
        eye = torch.eye(T, dtype=torch.bool, device=adt.device)
        W = torch.where(eye[None], torch.zeros((), dtype=adt.dtype, device=adt.device), torch.exp(seg) * scale.T[:, None, :])
        scores = torch.einsum("ihn,jhn->hij", q, k) * W
        from_start = torch.exp(torch.cumsum(adt, dim=0))                         # (T, h)
        y = torch.einsum("hij,jhp->ihp", scores, v) + from_start[:, :, None] * torch.einsum("hpn,ihn->ihp", start, q)
        to_end = torch.exp(seg[:, -1, :]) * scale.T                               # (h, T): token j's weight at the end
        return y, torch.einsum("hj,jhp,jhn->hpn", to_end, v, k) + from_start[-1][:, None, None] * start

    return _by_sequence(t, cu_seqlens, body)


def chunked(t: dict, cu_seqlens=None, chunk_size: int = 8) -> Evaluation:
    def body(q, k, v, adt, scale, S):
        parts = []                              # S: the state entering each chunk, before that chunk's decay
        for c0 in range(0, adt.shape[0], chunk_size):
            c1 = min(adt.shape[0], c0 + chunk_size)
            qc, kc, vc = q[c0:c1], k[c0:c1], v[c0:c1]
            seg = _segsum(adt[c0:c1])                                             # (h, Q, Q)
            strictly = torch.exp(seg) * scale[c0:c1].T[:, None, :]
            strictly = strictly - torch.diag_embed(torch.diagonal(strictly, dim1=-2, dim2=-1))
            qk = torch.einsum("ihn,jhn->hij", qc, kc)
            inner = torch.einsum("hij,jhp->ihp", qk * strictly, vc)
            from_start = torch.exp(torch.cumsum(adt[c0:c1], dim=0))              # (Q, h)
            parts.append(inner + from_start[:, :, None] * torch.einsum("hpn,ihn->ihp", S, qc))
            to_end = torch.exp(seg[:, -1, :]) * scale[c0:c1].T                    # (h, Q)
            S = from_start[-1][:, None, None] * S + torch.einsum("hj,jhp,jhn->hpn", to_end, vc, kc)
        return torch.cat(parts, dim=0), S

    return _by_sequence(t, cu_seqlens, body)


ORDERS = {"ref.recurrent": recurrent, "ref.quadratic": quadratic, "ref.chunked": chunked}


def call(name: str, case, tensors: dict) -> Evaluation:
    """Oracle order ``name`` on a mamba3 case's float64 tensors: y and the four final states."""
    if name == "ref.chunked":
        return chunked(tensors, bounds_of(case), case.chunk_size)
    return ORDERS[name](tensors, bounds_of(case))
