"""The same-precision baseline: what a correct chunked kernel naturally gets wrong in the case's dtype.

The verdict (harness/verdict/judge.py) does not hand-tune tolerances: it measures how far a *model kernel* lands
from the float64 oracle on the same case, and budgets the implementation a fixed multiple of that. This
module is the model kernel. It is the chunked evaluation order of every fast SSD kernel, computed the way
those kernels compute:

- arithmetic in float32 (register accumulators), including the dA cumsum, exp of segment sums, state passing,
  the D skip, the z gate and the gated RMSNorm; a decay factor below float32's smallest normal is flushed to
  zero in the perturbed samples, as a GPU kernel's exp flushes it (`Rounding.decay`);
- every operand of a matrix product rounded to the *dot precision*: the case dtype for float16 / bfloat16,
  TF32 (10-bit mantissa, truncated as Hopper's tensor cores read fp32 operands) for float32 on a CUDA GPU under
  Triton's default ``input_precision`` (the H200 table
  in SPEC.md section 7: GPU fp32 is TF32), float32 itself under the Triton interpreter or with
  ``TRITON_F32_DEFAULT=ieee``. The products rounded are the ones Mamba-2 kernels round: C, B; B scaled by
  its decay to the chunk end times dt; C.B^T scaled by the intra-chunk decay times dt; the states entering a
  chunk; x. The out_proj is torch's ``F.linear``, not a ``tl.dot``: its operands are the stored tensors,
  TF32 only where torch allows it (`linear_precision`);
- the elementwise roundings a later cancellation magnifies, each a rounding point of its own: the conv1d's
  partial sums, ``dt + dt_bias`` and softplus's ``exp(x) + 1``, the D skip's ``x * D``, the SwiGLU's
  products;
- tensors handed between stages in the dtype kernels store them in: the conv1d output, the scan output the
  gated RMSNorm reads, the normed output and y in the case dtype; dt, dA_cumsum, C.B^T and states in float32;
  the pre-gate output the z gate's backward reads (saved by the forward) in the case dtype;
- backward through the same graph in float32, every rounding point also rounding the gradient that flows
  back through it (the backward kernels' products take operands in the same precision), and each input's
  gradient returned in that input's dtype.

The layer entry is the mixer model with in_proj in front (`_layer`): torch's ``F.linear`` on the stored u and
weight (TF32 only where torch allows it), zxbcdt stored in the case dtype, ``A = -exp(A_log)`` in float32.

The decode entry has a model of its own (`step_scan`): the step recurrence of a selective-state-update
kernel in float32, one token at a time, with that kernel's rounding points — the state loaded from and stored
back in its dtype every step, dt processing (`_dt`), ``exp(A * dt)``, ``B * dt``, the update
``state * dA + dB * x``, the y reduction ``sum(state * C)`` over dstate, the D skip's ``x * D``, the z gate.

An implementation that evaluates token by token (its ``evaluation_order`` "recurrent", fla's fused and naive
recurrent simple_gla) is budgeted by this model in the token order as well (harness/examine.py adds those
samples; `scan`'s ``order``): chunk size 1, the state rounded once the token's own ``B x dt`` is added, y read
from it. Its rounding then grows with the tokens a state holds, where the chunked order's grows with the chunks.

`evaluate(case, inputs)` returns an `ssdiff.model.evaluation.Evaluation` (float64 tensors, the oracle's layouts and
stage names), so every output, gradient and stage has a baseline to be judged against. `evaluate_samples` gets
every sample the verdict needs from one evaluation (`evaluate_folded`: the samples folded into the batch rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ssdiff import runtime
from ssdiff.inputs import widen
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation, evaluate_graph
from ssdiff.inputs import Inputs
from ssdiff.model.stages import STAGE_ORDER
from ssdiff.verdict.judge import overflow_edge

COMPUTE = torch.float32
# The oracle at other inputs: (case, inputs) -> Evaluation (e.g. ssdiff.truth.evaluate).
OracleAt = Callable[[Case, Inputs], Evaluation]
_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def dot_precision(case: Case, device) -> str:
    """The precision matrix-product operands are rounded to on ``device``: "float16", "bfloat16", "tf32" or
    "float32". On a GPU, fp32 ``tl.dot`` is TF32 unless TRITON_F32_DEFAULT=ieee (`runtime.fp32_dot`); the
    interpreter computes fp32 products exactly."""
    if case.dtype in _LOW:
        return case.dtype
    if torch.device(device).type == "cuda" and runtime.fp32_dot() == "tf32":
        return "tf32"
    return "float32"


def linear_precision(case: Case, device) -> str:
    """The precision of the out_proj operands: ``F.linear`` in the case dtype is torch's matmul, not a Triton
    ``tl.dot`` (mamba_ssm ssd_combined.py, MambaSplitConv1dScanCombinedFn.forward: ``out = F.linear(out,
    outproj_weight, outproj_bias)``). fp32 on a CUDA GPU is TF32 only where torch allows it
    (``torch.backends.cuda.matmul.allow_tf32``, off by default); everywhere else the operands are used as they
    are (float16 / bfloat16 operands are already stored in the case dtype)."""
    if case.dtype in _LOW:
        return case.dtype
    if torch.device(device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "float32"


def round_to(t: torch.Tensor, precision: str) -> torch.Tensor:
    """``t`` (float32) rounded to ``precision`` and returned as float32 (no autograd)."""
    if precision == "float32":
        return t
    if precision == "tf32":
        # Hopper's tensor cores read fp32 operands of a TF32 product by dropping the 13 low mantissa bits
        # (truncation toward zero, not rounding): a biased error of up to 2^-10 that adds up coherently along a
        # sum. Modelled as such (an H200 fuzz run of mamba_chunk_scan_combined fp32 measured its errors at 2-8x
        # the round-to-nearest model).
        bits = t.contiguous().view(torch.int32)
        rounded = bits & ~0x1FFF
        finite = torch.isfinite(t)
        return torch.where(finite, rounded.view(torch.float32), t)
    return t.to(_LOW[precision]).to(t.dtype)


UNIT = {"float32": 2.0 ** -24, "tf32": 2.0 ** -10, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


class Signs:
    """A sample's random signs, one seeded generator per device (drawn where the tensor is: a sign tensor
    of a production-size case drawn on the host and copied costs more than the rest of the sample)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict = {}

    def like(self, t: torch.Tensor, shape: Optional[tuple] = None) -> torch.Tensor:
        """Signs of ``t``'s shape (or ``shape``), dtype and device."""
        gen = self._generators.get(t.device)
        if gen is None:
            gen = self._generators[t.device] = torch.Generator(device=t.device).manual_seed(self.seed)
        shape = t.shape if shape is None else shape
        return torch.randint(0, 2, shape, generator=gen, device=t.device, dtype=t.dtype) * 2 - 1

    def perturbed(self, t: torch.Tensor):
        """Whether each element of ``t`` belongs to a perturbed sample: all of them."""
        return True


class FoldedSigns:
    """The random signs of several evaluations folded into one (`evaluate_folded`): fold i of a tensor (rows
    i*m .. (i+1)*m - 1, m = its rows / the folds) draws from sample k_i's own generator, ``Signs(7919 k_i)``, in the
    order that evaluation alone would draw, so a folded sample is the sample evaluated alone; a fold of sample 0
    (round to nearest) gets zeros, which move nothing."""

    def __init__(self, samples: tuple):
        self.samples = tuple(samples)
        self._signs = [Signs(7919 * k) if k else None for k in self.samples]

    def like(self, t: torch.Tensor) -> torch.Tensor:
        if len(self._signs) == 1:
            return self._signs[0].like(t)
        m, rest = divmod(t.shape[0], len(self._signs))
        assert rest == 0 and m > 0, f"a rounding point's leading axis {t.shape[0]} is not {len(self._signs)} folds"
        parts, zeros = [], 0                    # consecutive folds of sample 0 share one block of zeros
        for s in self._signs:
            if s is None:
                zeros += 1
                continue
            if zeros:
                parts.append(t.new_zeros((zeros * m,) + t.shape[1:]))
                zeros = 0
            parts.append(s.like(t, (m,) + t.shape[1:]))
        if zeros:
            parts.append(t.new_zeros((zeros * m,) + t.shape[1:]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def perturbed(self, t: torch.Tensor):
        """Whether each row of ``t`` (its leading axis, the folds' rows) belongs to a perturbed sample's fold,
        shaped to broadcast against ``t``."""
        if len(self.samples) == 1:
            return bool(self.samples[0])
        # filled on the device (a tensor built from a host list would be a copy that waits for the device)
        m = t.shape[0] // len(self.samples)
        rows = torch.cat([torch.full((m,), k != 0, dtype=torch.bool, device=t.device) for k in self.samples])
        return rows.view((-1,) + (1,) * (t.dim() - 1))

    def fold(self, i: int) -> Optional[Signs]:
        """Fold i's own generator (None for a sample rounded to nearest), for a tensor of that fold alone."""
        return self._signs[i]


# Half the spacing of the subnormals, where they matter: below float16's smallest normal (6.1e-5) a rounding errs
# by up to 2^-25 whatever the value, not by u |t| (a gradient of a few 1e-6 held in float16 keeps a few bits).
# bfloat16 and float32 share float32's range: their subnormals sit far below any value a case stores (a decay
# factor may reach them: FLOAT32_TINY).
SUBNORMAL_HALF_SPACING = {"float16": 2.0 ** -25}
# float32's smallest normal, which bfloat16 and TF32 share. A GPU kernel's float32 exp flushes a result below it to
# zero (Triton on NVIDIA: libdevice in flush-to-zero mode, ex2.approx.ftz): see `Rounding.decay`.
FLOAT32_TINY = torch.finfo(torch.float32).tiny
# Where float16 overflows (verdict.overflow_edge: 65520). bfloat16 and float32 overflow far above any value a
# case produces.
OVERFLOW = {"float16": overflow_edge(torch.float16)}


def _perturb(t: torch.Tensor, precision: str, gen: Optional[Signs]) -> torch.Tensor:
    """``t`` moved by one rounding error with an independent random sign per element: u |t| (u: the precision's
    unit roundoff), or half the subnormal spacing where that is larger."""
    if gen is None:
        return t
    return _moved(t, precision, gen.like(t))


def _moved(t: torch.Tensor, precision: str, signs: torch.Tensor) -> torch.Tensor:
    """`_perturb` with its signs given. A value within one rounding error of the precision's overflow is moved
    outward whatever its sign, so that it overflows in every perturbed sample: a kernel that stores it there may
    store Inf (a float16 gradient of 65517.5 in mamba's fused mixer was Inf, the model's samples finite), and the
    verdict leaves out what a sample's overflow reaches."""
    u = UNIT[precision]
    moved = t * (1.0 + u * signs)
    floor = SUBNORMAL_HALF_SPACING.get(precision)
    if floor is not None:
        moved = torch.where(u * t.abs() >= floor, moved, t + floor * signs)
    edge = OVERFLOW.get(precision)
    if edge is not None:
        moved = torch.where(t.abs() * (1.0 + u) >= edge, t * (1.0 + u), moved)
    return moved


class _Round(torch.autograd.Function):
    """Round the value on the way forward and the gradient on the way back (perturbed first in a sample)."""

    @staticmethod
    def forward(ctx, t, precision, gen, perturb_value):
        ctx.precision, ctx.gen = precision, gen
        return round_to(_perturb(t, precision, gen if perturb_value else None), precision)

    @staticmethod
    def backward(ctx, grad):
        return round_to(_perturb(grad, ctx.precision, ctx.gen), ctx.precision), None, None, None


class _RoundGrad(torch.autograd.Function):
    """Identity on the way forward; round (perturbed first in a sample) the gradient on the way back."""

    @staticmethod
    def forward(ctx, t, precision, gen):
        ctx.precision, ctx.gen = precision, gen
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return round_to(_perturb(grad, ctx.precision, ctx.gen), ctx.precision), None, None


class _GateReadingStored(torch.autograd.Function):
    """The z gate ``y * silu(z)`` whose backward reads y as stored in ``precision`` (perturbed first in a
    sample): the forward gates the float32 y, the dz kernel loads the copy saved for it."""

    @staticmethod
    def forward(ctx, y, z, precision, gen):
        ctx.save_for_backward(round_to(_perturb(y, precision, gen), precision), z)
        return y * F.silu(z)

    @staticmethod
    def backward(ctx, grad):
        stored, z = ctx.saved_tensors
        s = torch.sigmoid(z)
        return grad * z * s, grad * stored * s * (1 + z * (1 - s)), None, None


class _PassStates(torch.autograd.Function):
    """The state passing between chunks, ``state_k = keep(carry_k * state_k-1 + grad_store(chunk_states_k))``, as
    one function: the forward and the backward recurrences in float32 with the rounding points `Rounding.keep`
    and `Rounding.grad_store` would put at every step, each step's random signs drawn for all the steps at once:
    one fused multiply-add a chunk each way. Returns the state after each chunk, (b, c, ...)."""

    @staticmethod
    def forward(ctx, chunk_states, carry, initial, store_precision, gen):
        carry6 = carry[..., None, None]                                        # (b, c, g, r, 1, 1)
        adds, muls = chunk_states, carry6
        if gen is not None:                  # grow (carry state + chunk state) = grow chunk state + grow carry state
            grow = 1.0 + UNIT["float32"] * gen.like(chunk_states)
            adds, muls = chunk_states * grow, carry6 * grow
        after, state = torch.empty_like(chunk_states), initial
        for add, mul, out in zip(adds.unbind(1), muls.unbind(1), after.unbind(1)):
            state = torch.addcmul(add, mul, state, out=out)
        ctx.save_for_backward(carry6, initial, after)
        ctx.store_precision, ctx.gen = store_precision, gen
        return after

    @staticmethod
    def backward(ctx, d_after):
        carry6, initial, after = ctx.saved_tensors
        gen, c = ctx.gen, after.shape[1]
        grow = None if gen is None else 1.0 + UNIT["float32"] * gen.like(after)
        muls = carry6 if grow is None else carry6 * grow
        # whole_k, the whole gradient of step k's state: whole_c-1 = d_after_c-1, whole_k-1 = d_after_k-1 +
        # grow_k carry_k whole_k; the gradient reaching step k's sum is grow_k whole_k
        whole = torch.empty_like(after)
        d_k, mul_k, whole_k = d_after.unbind(1), muls.unbind(1), whole.unbind(1)
        whole_k[c - 1].copy_(d_k[c - 1])
        for k in range(c - 1, 0, -1):
            torch.addcmul(d_k[k - 1], mul_k[k], whole_k[k], out=whole_k[k - 1])
        d_sum = whole if grow is None else whole * grow
        before = torch.cat([initial[:, None], after[:, :-1]], dim=1)
        d_carry = (d_sum * before).sum((-1, -2))
        d_chunk_states = d_sum
        if gen is not None or ctx.store_precision != "float32":
            d_chunk_states = round_to(d_sum if gen is None else _moved(d_sum, ctx.store_precision,
                                                                         gen.like(d_sum)), ctx.store_precision)
        return d_chunk_states, d_carry, carry6[:, 0] * d_sum[:, 0], None, None


class Rounding:
    """Where the model kernel rounds. ``dot``: a computed matrix-product operand (the dot precision);
    ``operand``: an input used as one (already exact in its dtype, so only TF32 rounds it); ``store``: a
    tensor stored in the case dtype between stages; ``keep``: one kept in float32.

    Sample 0 rounds to nearest. A sample k >= 1 first perturbs every rounding point by one unit roundoff of
    its precision with a random sign (forward and backward, seeded by k): the spread of the samples is the
    spread of the rounding error the computation naturally makes, so a budget taken as the largest of them
    does not depend on one lucky draw (a gradient summed over every token with cancellation is one number;
    a single baseline can land on it by chance)."""

    def __init__(self, dot_precision: str, store_precision: Optional[str], samples: tuple = (0,),
                 linear_precision: Optional[str] = None):
        """``samples``: the sample of each fold (`evaluate_folded`); one fold, (0,), when not folded."""
        self.gen = FoldedSigns(samples) if any(samples) else None
        self.dot_precision = dot_precision
        self.store_precision = store_precision
        self.linear_precision = linear_precision or dot_precision

    def fold(self, i: int) -> "Rounding":
        """This rounding for fold i's tensors alone (no fold axis)."""
        one = Rounding(self.dot_precision, self.store_precision, (0,), self.linear_precision)
        one.gen = self.gen.fold(i) if self.gen is not None else None
        return one

    def _apply(self, t, precision, perturb_value=True):
        if precision == "float32" and self.gen is None:
            return t
        return _Round.apply(t, precision, self.gen, perturb_value)

    def dot(self, t):
        return self._apply(t, self.dot_precision)

    def operand(self, t):
        return self._apply(t, self.dot_precision, perturb_value=False)

    def linear_operand(self, t):
        """An operand of torch's F.linear (the out_proj), in `linear_precision`."""
        return self._apply(t, self.linear_precision, perturb_value=False)

    def store(self, t):
        return self._apply(t, self.store_precision or "float32")

    def keep(self, t):
        return self._apply(t, "float32")

    def grad_store(self, t):
        """A result whose gradient the backward kernels store in the case dtype (the gradient reaching the
        pre-gate output through the z gate: Mamba-2's dz kernel writes it in the input dtype)."""
        if self.store_precision is None and self.gen is None:
            return t
        return _RoundGrad.apply(t, self.store_precision or "float32", self.gen)

    def gate(self, y, z):
        """The z gate ``y * silu(z)``: the gradient reaching y stored in the case dtype (`grad_store`), and dz
        computed from y as the forward saved it, in the case dtype (mamba_ssm's forward keeps the pre-gate
        output for the dz kernel): its rounding, and in float16 its overflow where |y| passes 65504."""
        y = self.grad_store(y)
        if self.store_precision is None and self.gen is None:
            return y * F.silu(z)
        return _GateReadingStored.apply(y, z, self.store_precision or "float32", self.gen)

    def pass_states(self, chunk_states, carry, initial):
        """The state entering each chunk and the final state (`_PassStates`): chunk_states (b, c, ...), carry
        (b, c, ...) without chunk_states' last two axes, initial (b, ...)."""
        after = _PassStates.apply(chunk_states, carry, initial, self.store_precision or "float32", self.gen)
        # with one chunk the entering state is the initial one (not a slice of `after`), so that when the final
        # state reaches no output the function's backward is not run at all
        entering = initial[:, None] if after.shape[1] == 1 else torch.cat([initial[:, None], after[:, :-1]], dim=1)
        return entering, after[:, -1]

    def decay(self, log_decay):
        """``exp(log_decay)`` in float32: a decay factor (a segment sum's, a cumsum's, a step's ``A * dt``). A GPU
        kernel's float32 exp flushes a result below float32's smallest normal (1.2e-38) to zero; the
        interpreter's keeps it. Where a value hangs on such a factor (dt > 20 with a strong decay), either result
        is right: every perturbed sample flushes the factor, round to nearest keeps it."""
        d = torch.exp(log_decay)
        if self.gen is None:
            return d
        return torch.where((d < FLOAT32_TINY) & self.gen.perturbed(d), torch.zeros_like(d), d)

    def grad_operand(self, t):
        """A product's result whose *gradient* the backward kernels round as an operand (Mamba-2's dstates
        kernel rounds dout * exp(dA_cs) to the input dtype before its dot with C)."""
        if self.dot_precision == "float32" and self.gen is None:
            return t
        return _RoundGrad.apply(t, self.dot_precision, self.gen)


EXACT = Rounding("float32", None)


def over_rows(p: Optional[torch.Tensor], folds: int, rows: int, lead: int = 0) -> Optional[torch.Tensor]:
    """A parameter as the rows of folded activations see it. Not folded (``folds`` 0) it is shared and returned
    as is; folded, it carries a leading axis of ``folds`` and each of the ``rows`` gets its fold's value, with
    ``lead`` unit axes after the row axis for broadcasting: (folds, *s) -> (rows, 1 x lead, *s)."""
    if p is None or not folds:
        return p
    per_row = p.repeat_interleave(rows // folds, dim=0)
    return per_row.reshape(per_row.shape[:1] + (1,) * lead + per_row.shape[1:])


class _LinearReading(torch.autograd.Function):
    """x @ weight^T (weight (o, d), or one per row (rows, o, d)) whose weight gradient reads ``read`` instead of x:
    the input as the backward recomputes it. x's gradient is the upstream gradient times the weight."""

    @staticmethod
    def forward(ctx, x, read, weight):
        ctx.save_for_backward(read, weight)
        return torch.matmul(x, weight.transpose(-1, -2))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        read, weight = ctx.saved_tensors
        d_weight = torch.matmul(grad.transpose(-1, -2), read)                # (..., o, d)
        if weight.dim() == 2:
            d_weight = d_weight.reshape((-1,) + d_weight.shape[-2:]).sum(0)
        return torch.matmul(grad, weight), None, d_weight


def _linear(x, weight, bias, folds: int, read: Optional[torch.Tensor] = None):
    """torch's F.linear; folded, each row with its fold's weight and bias (a batched matmul). ``read``: the input
    the weight's gradient reads, where the backward recomputes it (`_LinearReading`)."""
    if not folds and read is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    w = over_rows(weight, folds, rows) if folds else weight
    out = torch.matmul(x, w.transpose(-1, -2)) if read is None else _LinearReading.apply(x, read, w)
    if bias is None:
        return out
    return out + (over_rows(bias, folds, rows, lead=1) if folds else bias)


def scan(x, dt, A, B, C, *, chunk_size, rounding: Rounding = EXACT, D=None, z=None, dt_bias=None, dt_softplus=False,
         dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, want_varlen=False, folds: int = 0,
         order: str = "chunked"):
    """The model kernel's scan on float32 tensors, rounding as ``rounding`` says.
    Returns (y, final_states, varlen_states, stages) in float32. ``folds``: 0, or the evaluations folded into
    the batch rows (`evaluate_folded`: A, D, dt_bias then carry a leading axis of folds; varlen_states is
    (folds, nseq, h, p, n)). ``order`` "recurrent" (chunk_size 1): each token's y is C times the state after
    it, ``h_t = keep(exp(dA_t) h_t-1 + B_t x_t dt_t)``, as a token recurrence reads it."""
    dot, operand, keep = rounding.dot, rounding.operand, rounding.keep
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Q = chunk_size
    c = -(-L // Q)
    pad = c * Q - L
    r = h // g
    dev = x.device

    A = over_rows(A, folds, b, lead=2)                                       # (h,), or (b, 1, 1, h) folded
    d = keep(_dt(dt, over_rows(dt_bias, folds, b, lead=1), dt_softplus, dt_limit, rounding))   # (b, L, h) fp32
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=dev)

    def chunks(t):
        if pad:
            t = torch.cat([t, t.new_zeros((b, pad) + t.shape[2:])], dim=1)
        return t.reshape((b, c, Q) + t.shape[2:])

    seq_c = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).reshape(b, c, Q) if pad else seq.reshape(b, c, Q)
    real_c = seq_c >= 0
    d_c = chunks(d)                                                          # (b, c, Q, h)
    cs = keep(torch.cumsum(d_c * A, dim=2))                                  # fp32 cumsum inside each chunk
    cs_g = cs.reshape(b, c, Q, g, r)
    d_g = d_c.reshape(b, c, Q, g, r)
    x_c = chunks(x).reshape(b, c, Q, g, r, p)
    B_c, C_c = chunks(B), chunks(C)                                          # (b, c, Q, g, n)
    xq = operand(x_c)

    # C.B^T per chunk and group, float32 out.
    Cq, Bq = operand(C_c), operand(B_c)
    CB = keep(torch.einsum("bcign,bcjgn->bcgij", Cq, Bq))                   # (b, c, g, Q, Q)

    # Intra-chunk: (C.B^T * decay(i <- j) * dt_j), rounded as a product operand, times x.
    same = (seq_c[:, :, :, None] == seq_c[:, :, None, :]) & real_c[:, :, :, None] & real_c[:, :, None, :]
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev))
    allowed = (same & causal)[:, :, None, None]                              # (b, c, 1, 1, i, j)
    # Segment sums sum_{j<s<=i} dA_s. Forward, their value is cs_i - cs_j in float32, as kernels compute
    # exp(dA_cs_m - dA_cs_k): its rounding grows with |cs|, not with the segment. Backward, the gradient flows
    # through the direct sum, as in the "stable" backward kernels (through cs_i - cs_j it would cancel
    # catastrophically in the gradient of A under strong decay, which Mamba-2's backward avoids).
    dA_g = (d_c * A).reshape(b, c, Q, g, r).permute(0, 1, 3, 4, 2)          # (b, c, g, r, Q)
    later = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev), diagonal=-1)   # [s, j]: s > j
    direct = torch.cumsum(torch.where(later, dA_g[..., :, None], torch.zeros((), dtype=dA_g.dtype, device=dev)),
                          dim=-2)                                            # (b, c, g, r, i, j)
    csT = cs_g.permute(0, 1, 3, 4, 2)                                        # (b, c, g, r, Q)
    seg = direct + ((csT[..., :, None] - csT[..., None, :]) - direct).detach()
    decay = rounding.decay(torch.where(allowed, seg, torch.full_like(seg, -math.inf)))
    W = dot(CB[:, :, :, None] * decay * d_g.permute(0, 1, 3, 4, 2)[..., None, :])      # (b, c, g, r, i, j)
    y_diag = torch.einsum("bcgrij,bcjgrp->bcigrp", W, xq)

    # Each chunk's own end state: B scaled by decay-to-end and dt, rounded, times x.
    last_seq = seq_c[:, :, -1]
    own = (seq_c == last_seq[:, :, None]) & real_c                           # (b, c, Q)
    to_end = rounding.decay(seg[..., -1, :]).permute(0, 1, 4, 2, 3) * d_g * own[..., None, None]  # (b, c, Q, g, r)
    Bs = dot(Bq[:, :, :, :, None, :] * to_end[..., None])                    # (b, c, Q, g, r, n)
    chunk_states = keep(torch.einsum("bcjgrp,bcjgrn->bcgrpn", xq, Bs))

    # State passing in float32.
    prev_last = torch.cat([torch.zeros_like(last_seq[:, :1]), last_seq[:, :-1]], dim=1)
    survives = (last_seq == prev_last) & (last_seq >= 0)
    chunk_decay = rounding.decay(cs_g[:, :, -1])
    # Backward, the gradient of the state at each chunk boundary (dstates) runs through the recurrence in
    # float32 but is stored in the input dtype where it is used: for the chunk states' inputs and as the
    # initial states' gradient (Mamba-2's state-passing backward, dstates_dtype=x.dtype).
    state = rounding.grad_store(initial_states.reshape(b, g, r, p, n)) if initial_states is not None \
        else x.new_zeros(b, g, r, p, n)
    passed, state = rounding.pass_states(chunk_states, chunk_decay * survives[..., None, None], state)
    final = state.reshape(b, h, p, n)                                        # passed: (b, c, g, r, p, n)

    # Inter-chunk: C times the entering state (both rounded), scaled by the decay from the chunk start.
    if order == "recurrent":
        if Q != 1:
            raise ValueError(f"the recurrent order is the model at chunk size 1, not {Q}")
        after = torch.cat([passed[:, 1:], state[:, None]], dim=1)            # the state after each token
        y = keep(rounding.grad_operand(torch.einsum("bcign,bcgrpn->bcigrp", Cq, dot(after))))
    else:
        reaches = (seq_c == prev_last[:, :, None]) & real_c
        from_start = rounding.decay(cs_g) * reaches[..., None, None]         # (b, c, Q, g, r)
        y_off = rounding.grad_operand(torch.einsum("bcign,bcgrpn->bcigrp", Cq, dot(passed))) * from_start[..., None]
        y = keep(y_diag + y_off)
    y = y.reshape(b, c * Q, h, p)[:, :L]

    inside = (torch.arange(c * Q, device=dev) < L).reshape(c, Q)
    stages = {
        "dt": d,
        "dA_cumsum": cs.reshape(b, c * Q, h)[:, :L],
        "chunk_states": chunk_states.reshape(b, c, h, p, n),
        "passed_states": passed.reshape(b, c, h, p, n),
        "CB": CB * inside[None, :, None, :, None] * inside[None, :, None, None, :],
        "scan": y,
    }
    varlen = None
    if want_varlen and seq_idx is not None and b == max(folds, 1):
        ends = [_sequence_end_states(seq[i], seg[i], cs_g[i], d_g[i], xq[i], Bq[i], passed[i], prev_last[i], Q, L,
                                     rounding.fold(i) if folds else rounding) for i in range(b)]
        varlen = (torch.stack(ends) if ends[0] is not None else None) if folds else ends[0]
    if D is not None:
        # acc += x * D in float32 (mamba_ssm ssd_chunk_scan.py): the scan and the skip may cancel.
        per_head = D.dim() == (2 if folds else 1)
        D = over_rows(D, folds, b, lead=1)
        y = y + keep((D[..., None] if per_head else D) * x)
        stages["skip"] = y
    if z is not None:
        y = rounding.gate(y, z)
        stages["gated"] = y
    return y, final, varlen, stages


def _dt(dt, dt_bias, dt_softplus, dt_limit, rounding: Rounding = EXACT):
    """dt as the chunk-cumsum kernel computes it in float32 (mamba_ssm ssd_chunk_state.py,
    _chunk_cumsum_fwd_kernel): ``dt += dt_bias``, softplus below 20, clamped to dt_limit. The softplus is
    Triton 3's ``log(exp(x) + 1)`` (mamba_ssm/ops/triton/softplus.py, both releases): ``exp(x) + 1`` rounds to
    float32 first, an absolute error of u that the log hands on unchanged, so dt ~ 0.05 (the usual pre-softplus
    -3) carries u / dt ~ 20 units of relative error. Both sums are rounding points. The clamp's gradient passes a
    value exactly on a bound, as the kernels' and the oracle's do."""
    keep = rounding.keep
    if dt_bias is not None:
        dt = keep(dt + dt_bias)
    if dt_softplus:
        below = dt <= 20.0
        dt = torch.where(below, torch.log(keep(torch.exp(torch.where(below, dt, torch.zeros_like(dt))) + 1.0)), dt)
    low, high = dt_limit
    return dt.clamp(min=low, max=None if high == math.inf else high)


def step_scan(x, dt, A, B, C, state, *, rounding: Rounding = EXACT, state_precision: str = "float32", D=None,
              z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), folds: int = 0):
    """The model step kernel: ``x.shape[1]`` single-token steps from ``state`` on float32 tensors.

    x (b, s, h, p), dt (b, s, h), A (h,), B/C (b, s, g, n), state (b, h, p, n) as loaded (already in its dtype),
    D (h,) or (h, p), z like x, dt_bias (h,). As mamba_ssm's _selective_scan_update_kernel computes a step with
    the per-head parameters broadcast over headdim (Mamba-2's tie_hdim): dt (+ dt_bias, softplus) once per head
    in float32; dA = exp(A * dt); dB = B * dt; state = state * dA + dB * x, stored back in ``state_precision``;
    y = sum_n state * C in float32; y += x * D; y *= silu(z). Returns (y (b, s, h, p), final state), float32.
    ``folds`` as for `scan`."""
    keep = rounding.keep
    b, steps, h, p = x.shape
    g = B.shape[2]
    heads = torch.arange(h, device=x.device) // (h // g)
    A, dt_bias = over_rows(A, folds, b), over_rows(dt_bias, folds, b)
    per_head = D is not None and D.dim() == (2 if folds else 1)
    D = over_rows(D, folds, b)
    ys = []
    for t in range(steps):
        d = _dt(dt[:, t], dt_bias, dt_softplus, dt_limit, rounding)             # (b, h)
        dA = keep(rounding.decay(keep(A * d)))[..., None, None]                # (b, h, 1, 1)
        dB = keep(B[:, t][:, heads] * d[..., None])                            # (b, h, n)
        update = keep(dB[:, :, None, :] * x[:, t][..., None])                  # (b, h, p, n)
        state = rounding._apply(keep(keep(state * dA) + update), state_precision)
        y = keep((state * C[:, t][:, heads][:, :, None, :]).sum(-1))           # (b, h, p)
        if D is not None:
            y = keep(y + keep((D[..., None] if per_head else D) * x[:, t]))
        if z is not None:
            y = y * F.silu(z[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


def _conv(xBC, weight, bias, seq, activation, rounding: Rounding = EXACT, folds: int = 0,
          stored_before_activation: bool = False):
    """The depthwise causal conv1d as causal_conv1d computes it (float32; the bias first, then one
    multiply-add per tap, oldest first), each partial sum a rounding point: where the taps cancel, their
    rounding (u times the partial sums) is most of the output's error. A tap from another sequence (seq_idx)
    counts nothing. ``stored_before_activation``: the conv output is stored (`Rounding.store`) before the
    activation, as a layer that runs torch's conv1d and its silu as two ops does; silu's slope magnifies that
    rounding for negative inputs (relative by |1 + a (1 - sigmoid(a))|, 9 at a = -10). (b, L, ch) -> (b, L, ch)."""
    b, L, ch = xBC.shape
    W = weight.shape[-1]
    weight = over_rows(weight, folds, b, lead=1)                             # (ch, W), or (b, 1, ch, W) folded
    acc = over_rows(bias, folds, b, lead=1).expand(b, L, ch)
    for k in range(W):
        shift = W - 1 - k                                                    # tap k reads `shift` tokens back
        if shift >= L:
            continue
        src = F.pad(xBC, (0, 0, shift, 0))[:, :L]
        if shift:
            src = src * (F.pad(seq, (shift, 0), value=-2)[:, :L] == seq).to(src.dtype)[..., None]
        acc = rounding.keep(acc + weight[..., k] * src)
    if activation != "silu":
        return acc
    return F.silu(rounding.store(acc) if stored_before_activation else acc)


def _norm(y, z, weight, ngroups, eps, norm_before_gate, rounding: Rounding = EXACT):
    """The gated RMSNorm as mamba_ssm's layer-norm kernels compute it in float32: the normalized value a rounding
    point (`Rounding.keep`) on the way forward, and so is its gradient, dy * weight, on the way back, where the
    backward kernel takes the component of dy * weight orthogonal to the normalized value (a difference of terms
    that can be far larger than the result, each rounded in float32)."""
    gate = F.silu(z)
    v = y if norm_before_gate else y * gate
    grouped = v.unflatten(-1, (ngroups, -1))
    normalized = rounding.keep(grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps))
    normed = normalized.flatten(-2) * weight
    return normed * gate if norm_before_gate else normed


def _swiglu(zx0, d_nonssm, rounding: Rounding = EXACT):
    """The SwiGLU branch as mamba_ssm's _swiglu_fwd_kernel computes it in float32 (k_activations.py:
    ``x * tl.sigmoid(x) * y``), each product a rounding point."""
    x, y = zx0.split(d_nonssm, dim=-1)
    keep = rounding.keep
    return keep(keep(x * keep(torch.sigmoid(x))) * y)


def _sequence_end_states(seq, seg, cs_g, d_g, x_c, B_c, passed, prev_last, Q, L, rounding: Rounding = EXACT):
    """The state after the last token of each sequence of one batch row, in float32: (nseq, h, p, n); the
    products' operands rounded as for the chunk states (B scaled by decay and dt; the entering state)."""
    at, before = seq.tolist(), prev_last.tolist()           # read once: a device scalar read per token is a sync
    ends = [t for t in range(L) if at[t] >= 0 and (t == L - 1 or at[t + 1] != at[t])]
    states = []
    for t in ends:
        k, i = divmod(t, Q)
        members = seq[k * Q:k * Q + i + 1] == at[t]
        w = rounding.decay(seg[k, :, :, i, :i + 1]).permute(2, 0, 1) * d_g[k, :i + 1] * members[:, None, None]
        Bs = rounding.dot(B_c[k, :i + 1, :, None, :] * w[..., None])                     # (j, g, r, n)
        state = torch.einsum("jgrp,jgrn->grpn", x_c[k, :i + 1], Bs)
        if at[t] == before[k]:
            state = state + rounding.decay(cs_g[k, i])[..., None, None] * rounding.dot(passed[k])
        g, r, p, n = state.shape
        states.append(state.reshape(g * r, p, n))
    return torch.stack(states) if states else None


def _mixer_scan(case: Case, rounding: Rounding, x, dt, A, B, C, *, D, z, dt_bias, initial_states, seq_idx, folds):
    """The mixer's scan: the chunked model, or for a decoded layer (``layer_steps``) the chunked model over the
    prefill and the step model (`step_scan`) over the decoded tokens from its final state, held in the state
    dtype of the layer's cache (its in_proj's dtype: the case dtype). Returns (y, final, stages); a decoded
    layer exposes no SSD stages (its steps have none)."""
    kw = dict(rounding=rounding, dt_bias=dt_bias, dt_softplus=True, dt_limit=case.dt_limit_or_default, folds=folds)
    if not (case.entry == "layer" and case.layer_steps):
        y, final, _, stages = scan(x, dt, A, B, C, chunk_size=case.chunk_size, D=D, z=z, initial_states=initial_states,
                                   seq_idx=seq_idx, **kw)
        return y, final, stages
    P = case.seqlen - case.layer_steps
    cut = lambda t, a, b: t[:, a:b] if t is not None else None
    y0, state, _, _ = scan(cut(x, 0, P), cut(dt, 0, P), A, cut(B, 0, P), cut(C, 0, P), chunk_size=case.chunk_size,
                           D=D, z=cut(z, 0, P), **kw)
    state = rounding._apply(state, case.dtype)              # the cache holds the state in the case dtype
    y1, final = step_scan(cut(x, P, None), cut(dt, P, None), A, cut(B, P, None), cut(C, P, None), state,
                          state_precision=case.dtype, D=D, z=cut(z, P, None), **kw)
    return torch.cat([y0, y1], dim=1), final, {}


def _mixer(tensors, case: Case, seq_idx, rounding: Rounding, folds: int):
    """The fused mixer: conv1d (stored in the case dtype) -> scan -> gated RMSNorm (stored) -> out_proj.
    ``folds`` as for `scan` (the parameters carry a leading axis of folds)."""
    h, p, g, n = case.nheads, case.headdim, case.ngroups, case.dstate
    dim = case.dim
    b, L, _ = tensors["zxbcdt"].shape
    zx0, z, xBC, dt = torch.split(tensors["zxbcdt"], [2 * case.d_nonssm, dim, dim + 2 * g * n, h], dim=-1)
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, L, dtype=torch.long, device=xBC.device)
    store = rounding.store
    # fla's and transformers' torch paths run torch's conv1d and then the activation: a layer's conv output is
    # stored before it (the fused mixer's conv applies silu to its float32 sum)
    xBC = store(_conv(xBC, tensors["conv1d_weight"], tensors["conv1d_bias"], seq, case.activation, rounding, folds,
                      stored_before_activation=case.entry == "layer"))
    x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
    rms = tensors.get("rmsnorm_weight")
    zh = z.unflatten(-1, (h, p))
    # Without the norm the scan gates in float32, and with an out_proj the fused backward (mamba_ssm's
    # MambaSplitConv1dScanCombinedFn, recompute_output) takes the weight's gradient from the gated output its dz
    # kernel recomputes from the pre-gate output the forward stored in the case dtype: recomputed here, gated here.
    recompute = (case.backward and rms is None and "outproj_weight" in tensors
                 and not (case.entry == "layer" and case.layer_steps))
    y, final, stages = _mixer_scan(
        case, rounding, x.unflatten(-1, (h, p)), dt, tensors["A"], B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),
        D=tensors["D"], z=None if rms is not None or recompute else zh, dt_bias=tensors["dt_bias"],
        initial_states=tensors.get("initial_states"), seq_idx=seq_idx, folds=folds)
    stages = {"conv": xBC, **stages}
    recomputed = None
    if recompute:
        recomputed = store(store(y.detach()) * F.silu(zh.detach())).flatten(-2)
        y = stages["gated"] = rounding.gate(y, zh)
    y = y.flatten(-2)
    if rms is not None:
        # The chunk scan writes y in the case dtype and the norm kernel reads it (and writes the gradient of its
        # input in that dtype on the way back): both rounding points, which the norm's cancellation can amplify
        # (measured: one token, a 2-wide group, fp16: a gradient of D 0.55 off relative, in mamba's fused mixer,
        # its ref and ssdiff's kernel alike, bit for bit).
        y = _norm(store(y), z, over_rows(rms, folds, b, lead=1), g, case.rmsnorm_eps, case.norm_before_gate, rounding)
    if case.d_nonssm:
        swiglu = _swiglu(zx0, case.d_nonssm, rounding)
        y = torch.cat([swiglu, y], dim=-1)
        if recomputed is not None:
            recomputed = torch.cat([swiglu.detach(), recomputed], dim=-1)
    if rms is not None or case.d_nonssm:
        y = store(y)
        stages["normed"] = y
    if "outproj_weight" in tensors:
        y = _linear(rounding.linear_operand(y), rounding.linear_operand(tensors["outproj_weight"]),
                    tensors.get("outproj_bias"), folds,
                    read=None if recomputed is None else rounding.linear_operand(recomputed))
    return y, final, stages


def _layer(tensors, case: Case, seq_idx, rounding: Rounding, folds: int):
    """The whole layer: in_proj (torch's F.linear, its output stored in the case dtype: every layer hands zxbcdt
    to its kernels in it), A = -exp(A_log) in float32, then the fused mixer model (`_mixer`)."""
    u = tensors["u"]
    zxbcdt = rounding.store(_linear(rounding.linear_operand(u), rounding.linear_operand(tensors["in_proj_weight"]),
                                    tensors.get("in_proj_bias"), folds))
    bias = tensors.get("conv1d_bias")
    mixer_tensors = dict(tensors, zxbcdt=zxbcdt, A=rounding.keep(-torch.exp(tensors["A_log"])),
                         conv1d_bias=bias if bias is not None else u.new_zeros(tensors["conv1d_weight"].shape[:-1]))
    y, final, stages = _mixer(mixer_tensors, case, seq_idx, rounding, folds)
    return y, final, {"in_proj": zxbcdt, **stages}


SAMPLES = 3


# Inputs without a batch axis: a folded evaluation stacks them on a leading axis of folds (the others are
# concatenated along the batch rows).
PARAMETERS = frozenset({"A", "A_log", "D", "dt_bias", "conv1d_weight", "conv1d_bias", "rmsnorm_weight", "outproj_weight",
                        "outproj_bias", "in_proj_weight", "in_proj_bias"})


# The model in the token order (a token-recurrent side's budget, harness/examine.py) keeps every token's state,
# (b, L, h, p, n) in float32, for each of its folded samples, forward and backward (about three copies). Past this,
# a case is not judged for such a side rather than judged by the chunked order's budget alone: a production shape
# (L=16K, h=128, p=64, n=128) would need about 1 TiB.
TOKEN_MODEL_BYTES = 8 << 30


def token_model_too_large(case: Case) -> Optional[str]:
    """Why the model in the token order cannot budget ``case`` (TOKEN_MODEL_BYTES), or None."""
    need = case.batch * case.seqlen * case.nheads * case.headdim * case.dstate * 4 * (SAMPLES + NEIGHBOURS) * 3
    if need <= TOKEN_MODEL_BYTES:
        return None
    return (f"the baseline of a token-by-token evaluation (the model in the token order) would hold more than "
            f"{TOKEN_MODEL_BYTES >> 30} GiB of states")


def evaluate(case: Case, inputs: Inputs, device: Optional[str] = None, sample: int = 0) -> Evaluation:
    """The model kernel on ``case``: outputs, stages and (backward cases) gradients, as float64 tensors.
    ``device`` decides the dot precision (TF32 on a CUDA GPU for fp32); default: the inputs' device.
    ``sample`` 0 rounds to nearest; k >= 1 draws a perturbed sample (see `Rounding`)."""
    return evaluate_folded(case, [inputs], (sample,), device)[0]


def _fold(inputs: list) -> Inputs:
    """Several Inputs of one case as one: batch rows concatenated (fold i's rows i*b .. (i+1)*b - 1), PARAMETERS
    stacked on a leading axis, the cotangents and seq_idx repeated."""
    first, n = inputs[0], len(inputs)
    values = {name: (torch.stack if name in PARAMETERS else torch.cat)([i.values[name] for i in inputs])
              for name in first.values}
    repeat = lambda t: torch.cat([t] * n) if t is not None else None
    return dataclasses.replace(first, values=values, grad_outputs={k: repeat(v) for k, v in first.grad_outputs.items()},
                               seq_idx=repeat(first.seq_idx))


def evaluate_folded(case: Case, inputs: list, samples: tuple, device: Optional[str] = None,
                    order: str = "chunked") -> list:
    """`evaluate` of sample ``samples[i]`` at ``inputs[i]`` for every i, in one evaluation (``order``: `scan`'s, the
    chunk_scan entry's only): the inputs folded into the batch rows (`_fold`; a case's rows are independent, its
    parameters carried per fold), every rounding point
    drawing each fold's signs from that sample's own generator (`FoldedSigns`). One evaluation of a few small
    tensors launches as many kernels as one of a large tensor, and on a GPU the launches are what an evaluation
    costs. Returns one Evaluation per fold, each what that sample evaluated alone gives (up to the order of the
    larger products' sums)."""
    if order != "chunked" and case.entry != "chunk_scan":
        raise ValueError(f"the {order} order is modelled for the chunk_scan entry only, not {case.entry}")
    folds = len(inputs)
    first = inputs[0]
    device = device if device is not None else first.device
    rounding = Rounding(dot_precision(case, device), case.dtype if case.dtype in _LOW else None, tuple(samples),
                        linear_precision(case, device))
    folded = _fold(inputs) if folds > 1 else first
    n = folds if folds > 1 else 0                 # the model's folds argument: 0 when not folded
    leaves = folded.leaves(COMPUTE, requires_grad=case.backward)

    def forward() -> Evaluation:
        if case.entry == "decode":
            P = case.prefill_len
            cut = lambda name: leaves[name][:, P:] if name in leaves else None
            y, final = step_scan(cut("x"), cut("dt"), leaves["A"], cut("B"), cut("C"), leaves["state"],
                                 rounding=rounding, state_precision=case.state_dtype, D=leaves.get("D"), z=cut("z"),
                                 dt_bias=leaves.get("dt_bias"), dt_softplus=case.dt_softplus,
                                 dt_limit=case.dt_limit_or_default, folds=n)
            outputs = {"y": rounding.store(y)}
            if case.return_final_states:
                outputs["final_states"] = final
            return Evaluation(outputs)
        if case.entry == "chunk_scan":
            y, final, varlen, stages = scan(
                leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=case.chunk_size,
                rounding=rounding, D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
                dt_softplus=case.dt_softplus, dt_limit=case.dt_limit_or_default,
                initial_states=leaves.get("initial_states"), seq_idx=folded.seq_idx, want_varlen=case.varlen_states,
                folds=n, order=order)
        else:
            model = _layer if case.entry == "layer" else _mixer
            y, final, stages = model(leaves, case, folded.seq_idx, rounding, n)
            varlen = None
        y = rounding.store(y)
        outputs = {"y": y}
        if case.return_final_states:
            outputs["final_states"] = rounding.keep(final)
        if case.varlen_states and varlen is not None:
            outputs["varlen_states"] = varlen
        stages["y"] = y
        return Evaluation(outputs, stages={k: stages[k] for k in STAGE_ORDER if k in stages})

    result = evaluate_graph(case, folded, leaves, forward)

    def by_fold(name, t, kind):
        """The folds of a result along a leading axis: its rows regrouped, or (parameters' gradients,
        varlen_states) its fold axis as it is."""
        if folds == 1:
            return t[None]
        if (kind == "grads" and name in PARAMETERS) or name == "varlen_states":
            return t
        return t.reshape((folds, t.shape[0] // folds) + t.shape[1:])

    # each result converted once for every fold, then unbound into the folds' views
    split = lambda d, kind, cast=lambda k, t: t: {
        k: cast(k, by_fold(k, v, kind)).to(torch.float64).unbind(0) for k, v in d.items()}
    outputs, stages = split(result.outputs, "outputs"), split(result.stages, "stages")
    grads = split(result.grads, "grads", lambda k, t: t.to(first.dtypes[k]))
    at = lambda d, i: {k: v[i] for k, v in d.items()}
    return [Evaluation(outputs=at(outputs, i), stages=at(stages, i), grads=at(grads, i)) for i in range(folds)]


# Neighbour samples: the model kernel at inputs one unit roundoff away (each input element moved by +-2u of its
# dtype, then rounded to it), its error measured against the oracle at those same inputs. The perturbed samples
# above move the model's rounding points; these move the point the rounding happens at. Needed because a
# gradient summed over every token with cancellation (the gradient of A) can be exact by chance at one input:
# a 10-minute fuzz met a case where all three samples erred by 1e-9 to 2e-9 while inputs 1e-5 away gave the
# same model ~2e-8 — and mamba_chunk_scan_combined's (healthy, sign-varying) 4.85e-8 became a "divergence".
NEIGHBOURS = 2


def neighbour(inputs: Inputs, k: int) -> Inputs:
    """``inputs`` with every floating value moved by one random +-2u step of its dtype and rounded to it (the
    signs drawn where the values are, as a sample's)."""
    signs = Signs(104729 * k)
    values = {}
    for name, value in inputs.values.items():
        dtype = inputs.dtypes.get(name, torch.float64)
        if not value.is_floating_point():
            values[name] = value
            continue
        sign = signs.like(value)
        u = torch.finfo(dtype).eps / 2
        values[name] = (value * (1 + 2 * u * sign)).to(dtype).to(value.dtype)
    return dataclasses.replace(inputs, values=values)


def _shifted(base: Evaluation, truth: Evaluation, models: list, exacts: list) -> list:
    """For each neighbour (a model evaluation and the oracle's at its inputs): truth + (model - exact), key by key
    (``base``'s keys; ``base``'s value where a term is missing or not finite): a sample whose error against
    ``truth`` is the model's error at the neighbouring inputs. The neighbours of a key are computed together."""
    shifted = [{"outputs": {}, "grads": {}, "stages": {}} for _ in models]
    for field in ("outputs", "grads", "stages"):
        for key, fallback in getattr(base, field).items():
            t = getattr(truth, field).get(key)
            ms = [getattr(m, field).get(key) for m in models]
            es = [getattr(e, field).get(key) for e in exacts]
            if t is None or any(x is None or x.shape != t.shape for x in ms + es):
                for out in shifted:
                    out[field][key] = fallback
                continue
            v = t + (torch.stack(ms) - torch.stack(es))
            for out, value in zip(shifted, torch.where(torch.isfinite(v), v, fallback).unbind(0)):
                out[field][key] = value
    return [Evaluation(**parts) for parts in shifted]


def neighbours_of(inputs: Inputs, count: int = NEIGHBOURS) -> list:
    """The inputs of the neighbour samples: `neighbour` k = 1 .. ``count``."""
    return [neighbour(inputs, k) for k in range(1, count + 1)]


def evaluate_samples(case: Case, inputs: Inputs, truth: Evaluation, oracle: Optional[OracleAt] = None,
                     device: Optional[str] = None, samples: int = SAMPLES, neighbours: int = NEIGHBOURS,
                     at_neighbours: Optional[tuple] = None, order: str = "chunked") -> list:
    """``samples`` evaluations (round-to-nearest first, then perturbed ones), then ``neighbours`` samples at
    neighbouring inputs (see NEIGHBOURS). ``truth`` is the oracle at ``inputs``. ``at_neighbours``: (the
    neighbour inputs, `neighbours_of`; the oracle at each) where the caller has them, else ``oracle(case,
    inputs)`` evaluates them (side by side where the entry allows: harness/inputs/widen.py). The verdict's noise level
    at an element is the largest error among the samples. The model's evaluations are one folded evaluation
    (`evaluate_folded`, in ``order``)."""
    if at_neighbours is not None:
        near, exact = at_neighbours
    else:
        near = neighbours_of(inputs, neighbours)
        if near and oracle is None:
            raise ValueError("evaluate_samples: neighbour samples need the oracle (pass oracle=...)")
        exact = widen.evaluate(oracle, case, near) if near else []
    models = evaluate_folded(case, [inputs] * samples + near, tuple(range(samples)) + (0,) * len(near), device,
                             order)
    return models[:samples] + (_shifted(models[0], truth, models[samples:], exact) if near else [])
