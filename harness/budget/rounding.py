"""The same-precision model's rounding: where a correct chunked kernel rounds, and to what.

The verdict (harness/verdict/judge.py) does not hand-tune tolerances: it measures how far a *model kernel*
(ssdiff.budget.model) lands from the float64 oracle on the same case, and budgets an implementation a fixed
multiple of that. This module says how the model rounds (`Rounding`):

- arithmetic in float32 (register accumulators); a decay factor below float32's smallest normal is flushed to
  zero in the perturbed samples, as a GPU kernel's exp flushes it (`Rounding.decay`);
- every operand of a matrix product rounded to the *dot precision* (`dot_precision`): the case dtype for
  float16 / bfloat16, TF32 (10-bit mantissa, truncated as Hopper's tensor cores read fp32 operands) for float32
  on a CUDA GPU under Triton's default ``input_precision``, float32 itself under the Triton interpreter or with
  ``TRITON_F32_DEFAULT=ieee`` (harness/truth/README.md, "Precision on the two runtimes"). torch's ``F.linear``
  (the out_proj, the layer's in_proj) rounds its operands to TF32 only where torch allows it
  (`linear_precision`);
- the elementwise roundings a later cancellation magnifies, each a rounding point of its own;
- tensors handed between stages in the dtype kernels store them in (`Rounding.store`, `Rounding.keep`);
- backward through the same graph, every rounding point also rounding the gradient that flows back through it.

A sample is the model at round-to-nearest (sample 0) or with every rounding moved one way or the other by a
seeded random sign (`Signs`, `FoldedSigns` for several samples folded into the batch rows: `over_rows`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ssdiff import runtime
from ssdiff.model.case import Case
from ssdiff.model.dtypes import overflow_edge


COMPUTE = torch.float32


LOW_PRECISION = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def dot_precision(case: Case, device) -> str:
    """The precision matrix-product operands are rounded to on ``device``: "float16", "bfloat16", "tf32" or
    "float32". On a GPU, fp32 ``tl.dot`` is TF32 unless TRITON_F32_DEFAULT=ieee (`runtime.fp32_dot`); the
    interpreter computes fp32 products exactly."""
    if case.dtype in LOW_PRECISION:
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
    if case.dtype in LOW_PRECISION:
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
    return t.to(LOW_PRECISION[precision]).to(t.dtype)


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


def perturb(t: torch.Tensor, precision: str, gen: Optional[Signs]) -> torch.Tensor:
    """``t`` moved by one rounding error with an independent random sign per element: u |t| (u: the precision's
    unit roundoff), or half the subnormal spacing where that is larger."""
    if gen is None:
        return t
    return _moved(t, precision, gen.like(t))


def _moved(t: torch.Tensor, precision: str, signs: torch.Tensor) -> torch.Tensor:
    """`perturb` with its signs given. A value within one rounding error of the precision's overflow is moved
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
        return round_to(perturb(t, precision, gen if perturb_value else None), precision)

    @staticmethod
    def backward(ctx, grad):
        return round_to(perturb(grad, ctx.precision, ctx.gen), ctx.precision), None, None, None


class _RoundGrad(torch.autograd.Function):
    """Identity on the way forward; round (perturbed first in a sample) the gradient on the way back."""

    @staticmethod
    def forward(ctx, t, precision, gen):
        ctx.precision, ctx.gen = precision, gen
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return round_to(perturb(grad, ctx.precision, ctx.gen), ctx.precision), None, None


class _GateReadingStored(torch.autograd.Function):
    """The z gate ``y * silu(z)`` whose backward reads y as stored in ``precision`` (perturbed first in a
    sample): the forward gates the float32 y, the dz kernel loads the copy saved for it."""

    @staticmethod
    def forward(ctx, y, z, precision, gen):
        ctx.save_for_backward(round_to(perturb(y, precision, gen), precision), z)
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


__all__ = ["COMPUTE", "LOW_PRECISION", "dot_precision", "linear_precision", "round_to", "UNIT", "Signs", "FoldedSigns", "SUBNORMAL_HALF_SPACING", "FLOAT32_TINY", "OVERFLOW", "perturb", "Rounding", "EXACT", "over_rows"]
