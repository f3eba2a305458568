"""The float64 values of a Case's inputs, drawn from its seed: `draw` and the counter-based variates it uses
for large tensors.

A tensor of up to _DRAW_BLOCK elements comes from the case's CPU generator; a larger one (production shapes: tens
of millions of variates a case, most of a warm case's time when drawn on the host) from `counter_variates` on the
case's device, a keyed hash of each element's index in integer arithmetic and a table of the normal's quantiles,
which give the same bits on any device.

Self-contained on purpose: torch, math, statistics and functools only, and ``case`` may be any object with the
Case's attributes. repro.py inlines this module whole (harness/reproduce/repro.py), so every repro draws with
exactly the code ssdiff draws with.
"""

import functools
import math
import statistics

import torch
import torch.nn.functional as F

# Pre-softplus mean of dt and the range of |A| per decay regime (harness/truth/README.md, "Input regimes").
_DT_CENTER = {"none": -3.0, "mild": -3.0, "typical": -3.0, "strong": 0.5}
_A_RANGE = {"none": (1e-5, 1e-4), "mild": (0.05, 0.5), "typical": (1.0, 16.0), "strong": (30.0, 60.0)}
# A tensor of more elements than this is drawn by `counter_variates` on the case's device, keyed from the case's
# generator; smaller ones (every tensor a CPU campaign draws) come from the case's generator itself.
_DRAW_BLOCK = 2 ** 18
# `counter_variates`' normal: the inverse CDF interpolated between this many + 1 quantiles (tails cut at 4.32).
_NORMAL_KNOTS = 2 ** 16
# Variates `counter_variates` computes at a time.
_VARIATE_SLAB = 2 ** 26


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche hash of 32-bit values held in int64 (lowbias32: xor-shifts and two odd multipliers);
    the products are taken modulo 2**32 in 16-bit halves, so no intermediate leaves int64 on any device."""
    def times(v, c):
        return (v * (c & 0xFFFF) + (((v * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    x = times(x ^ (x >> 16), 0x7FEB352D)
    x = times(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=1)
def _normal_knots() -> tuple:
    """The normal's quantiles at (k + 0.5) / (_NORMAL_KNOTS + 1), k = 0.._NORMAL_KNOTS, and the steps between
    neighbours, as float64 CPU tensors: Python's own arithmetic (statistics.NormalDist), mirrored about 0."""
    normal, half = statistics.NormalDist(), _NORMAL_KNOTS // 2
    low = [normal.inv_cdf((k + 0.5) / (_NORMAL_KNOTS + 1)) for k in range(half)]
    knots = low + [0.0] + [-v for v in reversed(low)]
    steps = [b - a for a, b in zip(knots, knots[1:])]
    return torch.tensor(knots[:-1], dtype=torch.float64), torch.tensor(steps, dtype=torch.float64)


def counter_variates(kind: str, count: int, key, device="cpu") -> torch.Tensor:
    """``count`` float64 variates on ``device``, element i a function of (i, ``key``) alone: two 32-bit words from
    keyed `_mix32` rounds of i (``key``: four integers below 2**32), then "normal" (the inverse CDF between
    `_normal_knots`, at a 16-bit knot and a 48-bit fraction), "uniform" ([0, 1), 53 bits) or "integer" (-2..2).
    Integer operations and single IEEE roundings only, each its own operation: the same bits on every device.
    Computed _VARIATE_SLAB elements at a time (a huge case's 2**31 variates would otherwise need several int64
    temporaries of their size)."""
    out = torch.empty(count, dtype=torch.float64, device=device)
    knots, steps = (t.to(device) for t in _normal_knots())
    for start in range(0, count, _VARIATE_SLAB):
        i = torch.arange(start, min(count, start + _VARIATE_SLAB), dtype=torch.int64, device=device)
        low, high = i & 0xFFFFFFFF, i >> 32
        first = _mix32(_mix32(low ^ key[0]) ^ high ^ key[1])
        second = _mix32(_mix32(low ^ key[2]) ^ high ^ key[3])
        if kind == "integer":
            part = (first % 5 - 2).to(torch.float64)
        elif kind == "uniform":
            part = ((first << 21) | (second >> 11)).to(torch.float64) * 2.0 ** -53
        else:
            at = first >> 16
            fraction = (((first & 0xFFFF) << 32) | second).to(torch.float64) * 2.0 ** -48
            part = knots[at] + steps[at] * fraction
        out[start:start + i.numel()] = part
    return out


def draw(case, device="cpu", decay_only: bool = False) -> tuple:
    """The float64 values of every input (rounded once through its dtype), their dtypes, and the cotangents
    of backward cases: (values, dtypes, grad_outputs) on ``device``, drawn from ``case.seed``; the same numbers
    for any ``device``. ``decay_only``: A, dt and dt_bias alone (the first drawn, so the same values), what the
    decay conditions of harness/registry/known.py read.
    """
    gen = torch.Generator().manual_seed(case.seed)
    act = getattr(torch, case.dtype)           # float32, float16 or bfloat16
    r = case.regime

    def sample(kind, shape):
        """``shape`` variates of ``kind`` (as `counter_variates`): on the CPU from ``gen``, or, past _DRAW_BLOCK
        elements, `counter_variates` on ``device`` keyed from ``gen``."""
        count = math.prod(shape)
        if count > _DRAW_BLOCK:
            key = torch.randint(0, 2 ** 32, (4,), generator=gen).tolist()
            return counter_variates(kind, count, key, device).reshape(shape)
        if kind == "integer":
            return torch.randint(-2, 3, (count,), generator=gen).to(torch.float64).reshape(shape)
        fill = torch.randn if kind == "normal" else torch.rand
        return fill(count, generator=gen, dtype=torch.float64).reshape(shape)

    def normal(*shape, std=1.0, mean=0.0):
        return sample("normal", shape) * std + mean

    def uniform(*shape, lo=0.0, hi=1.0):
        return sample("uniform", shape) * (hi - lo) + lo

    def values(*shape):
        return sample("integer", shape) if r.values == "integer" else normal(*shape) * r.scale

    def cat(parts, dim):
        return torch.cat([t.to(device) for t in parts], dim=dim)

    b, L, h, p, g, n = case.batch, case.seqlen, case.nheads, case.headdim, case.ngroups, case.dstate
    vals, dtypes = {}, {}

    def put(name, tensor, dtype):
        # Round once through the dtype implementations get, keep float64.
        vals[name] = tensor.to(device).to(dtype).to(torch.float64)
        dtypes[name] = dtype

    # A: per-head decay rate, negative.
    lo, hi = _A_RANGE[r.decay]
    A = -torch.exp(uniform(h, lo=math.log(lo), hi=math.log(hi)))
    # dt: pre-activation values centred where the regime wants them.
    center = _DT_CENTER[r.decay]
    if case.dt_softplus:
        dt_raw = normal(b, L, h, mean=center / 2, std=0.7)
        dt_bias = normal(h, mean=center / 2, std=0.5)
        if not case.has_dt_bias:
            dt_raw = dt_raw + center / 2
        if r.dt_large:
            # Half the heads (at least one) above the softplus threshold 20, where softplus is the identity.
            shift = (torch.arange(h) % 2 == 0).to(torch.float64) * 22.0
            if case.has_dt_bias:
                dt_bias = dt_bias + shift
            else:
                dt_raw = dt_raw + shift.to(dt_raw.device)
    else:
        # on the CPU, like every transcendental here: a device's softplus may differ from the CPU's in the last bit
        dt_raw = F.softplus(normal(b, L, h, mean=center, std=1.0).cpu())
        dt_bias = normal(h, std=0.02)
        if r.dt_large:
            dt_raw = dt_raw + 22.0 * (torch.arange(h) % 2 == 0)
    if decay_only:
        put("A", A, torch.float32)
        put("dt", dt_raw, act)
        if case.has_dt_bias:
            put("dt_bias", dt_bias, torch.float32)
        return vals, dtypes, {}

    if case.entry in ("chunk_scan", "decode"):
        put("x", values(b, L, h, p), act)
        put("dt", dt_raw, act)
        put("A", A, torch.float32)
        put("B", values(b, L, g, n), act)
        put("C", values(b, L, g, n), act)
        if case.D == "head":
            put("D", normal(h), torch.float32)
        elif case.D == "channel":
            put("D", normal(h, p), torch.float32)
        if case.has_z:
            put("z", values(b, L, h, p), act)
        if case.has_dt_bias:
            put("dt_bias", dt_bias, torch.float32)
        y_shape = (b, L, h, p)
    elif case.entry == "layer":
        dim, conv_ch, d_model, d_inner = case.dim, case.conv_channels, case.d_model, case.d_inner
        put("u", values(b, L, d_model), act)
        # in_proj rows [SwiGLU branch, z, xBC, dt]: unit-variance outputs, the dt rows at std 0.7 (as dt above)
        rows = 2 * case.d_nonssm + dim + conv_ch
        std = 1.0 / math.sqrt(d_model)
        weight = cat([normal(rows, d_model, std=std), normal(h, d_model, std=0.7 * std)], dim=0)
        put("in_proj_weight", weight, act)
        if case.bias:
            put("in_proj_bias", normal(rows + h, std=0.1), act)
        put("conv1d_weight", normal(conv_ch, case.conv_width, std=1.0 / math.sqrt(case.conv_width)), act)
        if case.conv_bias:
            put("conv1d_bias", normal(conv_ch, std=0.1), act)
        put("dt_bias", dt_bias + center / 2, torch.float32)
        put("A_log", torch.log(-A), torch.float32)
        put("D", normal(h) if case.D == "head" else normal(h, p), torch.float32)
        if case.rmsnorm:
            put("rmsnorm_weight", 1.0 + normal(dim, std=0.2), act)
        put("outproj_weight", normal(d_model, d_inner, std=1.0 / math.sqrt(d_inner)), act)
        if case.bias:
            put("outproj_bias", normal(d_model, std=0.1), act)
        y_shape = (b, L, d_model)
    elif case.entry == "mamba3":
        # Mamba-3 (harness/truth/README.md): q, k over the ngroups B/C heads (dstate = headdim_qk), v per head
        # (headdim = headdim_v), DT the processed dt (softplus'd above), ADT = A * DT, trap and angles raw (the
        # kernel takes sigmoid(trap) and pi * tanh(angles)); biases, D, ADT, DT and the states but V's in float32.
        a = (int(case.dstate * case.rope_fraction) // 2 * 2) // 2      # Case.rope_angles (a case here may be any object)
        nseq = len(case.segments[0]) if case.segments is not None else b
        put("q", values(b, L, g, n), act)
        put("k", values(b, L, g, n), act)
        put("v", values(b, L, h, p), act)
        put("dt", dt_raw, torch.float32)
        put("adt", dt_raw.to(torch.float32).to(torch.float64) * A, torch.float32)
        put("trap", normal(b, L, h), act)
        put("q_bias", normal(h, n, std=0.5), torch.float32)
        put("k_bias", normal(h, n, std=0.5), torch.float32)
        put("angles", normal(b, L, h, a), act)
        if case.D == "head":
            put("D", normal(h), torch.float32)
        if case.has_z:
            put("z", values(b, L, h, p), act)
        if case.initial_states:
            put("init_angle", uniform(nseq, h, a, hi=2 * math.pi), torch.float32)
            put("initial_states", normal(nseq, h, p, n) * r.scale, torch.float32)
            put("init_k", normal(nseq, h, n) * r.scale, torch.float32)
            put("init_v", values(nseq, h, p), act)
        y_shape = (b, L, h, p)
    elif case.entry == "mamba3_layer":
        # the Mamba3 module (harness/truth/mamba3_layer.py): in_proj rows [z, x, B, C, dd_dt, dd_A, trap, angles] at
        # unit-variance outputs, the dd_dt rows at std 0.7 (as dt above; dt_bias carries the regime's centre)
        a = (int(case.dstate * case.rope_fraction) // 2 * 2) // 2      # Case.rope_angles
        d_model, dim = case.d_model, case.dim
        put("u", values(b, L, d_model), act)
        std = 1.0 / math.sqrt(d_model)
        put("in_proj_weight", cat([normal(2 * dim + 2 * g * n, d_model, std=std), normal(h, d_model, std=0.7 * std),
                                   normal(2 * h + a, d_model, std=std)], dim=0), act)
        put("dt_bias", dt_bias + center / 2, torch.float32)
        put("k_norm_weight", 1.0 + normal(n, std=0.2), act)
        put("q_norm_weight", 1.0 + normal(n, std=0.2), act)
        put("k_bias", 1.0 + normal(h, n, std=0.5), torch.float32)
        put("q_bias", 1.0 + normal(h, n, std=0.5), torch.float32)
        put("D", normal(h), torch.float32)
        if case.rmsnorm:
            put("rmsnorm_weight", 1.0 + normal(dim, std=0.2), act)
        put("outproj_weight", normal(d_model, dim, std=1.0 / math.sqrt(dim)), act)
        y_shape = (b, L, d_model)
    else:
        dim, conv_ch = case.dim, case.conv_channels
        zx0 = values(b, L, 2 * case.d_nonssm)
        z = values(b, L, dim)
        xBC = values(b, L, conv_ch)
        put("zxbcdt", cat([zx0, z, xBC, dt_raw], dim=-1), act)
        put("conv1d_weight", normal(conv_ch, case.conv_width, std=1.0 / math.sqrt(case.conv_width)), act)
        put("conv1d_bias", normal(conv_ch, std=0.1), act)
        put("dt_bias", dt_bias, torch.float32)
        put("A", A, torch.float32)
        put("D", normal(h) if case.D == "head" else normal(h, p), torch.float32)
        if case.rmsnorm:
            put("rmsnorm_weight", 1.0 + normal(dim, std=0.2), act)
        width = case.d_nonssm + dim
        if case.out_dim is not None:
            put("outproj_weight", normal(case.out_dim, width, std=1.0 / math.sqrt(width)), act)
            if case.outproj_bias:
                put("outproj_bias", normal(case.out_dim, std=0.1), act)
        y_shape = (b, L, case.out_dim if case.out_dim is not None else width)
    if case.initial_states and case.entry not in ("mamba3", "mamba3_layer"):
        put("initial_states", normal(b, h, p, n) * r.scale, torch.float32)

    grad_outputs = {}
    if case.backward:
        grad_outputs["y"] = normal(*y_shape).to(device).to(act).to(torch.float64)
        gaps = getattr(case, "gaps", None)
        if case.padding or gaps:
            # Outputs at padding tokens (trailing, or in a gap between two sequences) are unspecified (not judged):
            # no cotangent may carry them into gradients.
            real = torch.ones(b, L, dtype=torch.bool)
            for row in range(b):
                if case.padding:
                    real[row, L - case.padding[row]:] = False
                start = 0
                for length, gap in zip(case.segments[row], (0, *gaps[row]) if gaps else ()):
                    real[row, start:start + gap] = False
                    start += gap + length
            grad_outputs["y"] = grad_outputs["y"] * real.reshape(b, L, *[1] * (len(y_shape) - 2)).to(device)
        if case.final_state_grad:
            rows = len(case.segments[0]) if case.entry == "mamba3" and case.segments is not None else b
            grad_outputs["final_states"] = normal(rows, h, p, n).to(device).to(torch.float32).to(torch.float64)
    return vals, dtypes, grad_outputs
