"""Speed and accuracy of ssdiff's SSD kernels next to mamba_chunk_scan_combined and fla's chunk_simple_gla.

Not a test. On a CUDA GPU (an H200 for kernels/BENCHMARKS.md):

    python -m ssdiff.tools.kernel_benchmark                     # the five shapes of issue 7, bf16
    python -m ssdiff.tools.kernel_benchmark --shapes 2,4096,32,64,128,8 --dtype float16 --markdown out.md

Per shape (batch, seqlen, nheads, headdim, dstate, ngroups), chunk 256, Mamba-2-like inputs (D per head,
dt_bias, softplus; no z, no seq_idx), it prints for each implementation:
- forward and forward+backward milliseconds: the median over --rounds rounds that interleave the implementations
  (each a triton.testing.do_bench median; autotuning done before, at each shape afresh), with the rounds' min and
  max;
- the relative RMS error of y against the float64 chunked oracle (ssdiff.truth.chunked), computed on the
  heads of the first ``--error-groups`` groups (the float64 oracle of a whole 65536-token shape is too big);
- the memory-traffic lower bound: the bytes a kernel must at least move (read x, dt, B, C; write y — and for
  the backward also read dy and write dx, ddt, dB, dC), divided by --bandwidth (4.3 TB/s: H200 HBM3e, as the
  issue asks; the datasheet says 4.8).

fla has no grouped B/C: they are expanded to heads (repeat_interleave) and v = x * dt', g = dt' * A are formed
in torch, all inside the timed region (that is what using fla for SSD costs); y = o + D x likewise.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys

import torch
import torch.nn.functional as F

SHAPES = [(8, 2048, 32, 64, 128, 1), (8, 2048, 32, 64, 128, 8), (4, 8192, 64, 64, 128, 8),
          (2, 16384, 128, 64, 128, 8), (1, 65536, 128, 64, 128, 8)]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_inputs(shape, dtype, device, seed=0):
    b, L, h, p, n, g = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, L, h, p, device=device, generator=gen).to(dtype)
    dt = (torch.randn(b, L, h, device=device, generator=gen) * 0.7 - 1.5).to(dtype)
    dt_bias = (torch.randn(h, device=device, generator=gen) * 0.5 - 1.5).float()
    A = -torch.exp(torch.rand(h, device=device, generator=gen) * math.log(16.0)).float()
    B = torch.randn(b, L, g, n, device=device, generator=gen).to(dtype)
    C = torch.randn(b, L, g, n, device=device, generator=gen).to(dtype)
    D = torch.randn(h, device=device, generator=gen).float()
    dy = torch.randn(b, L, h, p, device=device, generator=gen).to(dtype)
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias), dy


def run_ssdiff(t, Q):
    from ssdiff.kernels.ssd.combined import ssd_chunk_scan_combined
    return ssd_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], Q, D=t["D"], dt_bias=t["dt_bias"],
                                   dt_softplus=True)


def run_mamba(t, Q):
    from ssdiff.sides import upstream
    fn = upstream.mamba_ssm().ssd_combined.mamba_chunk_scan_combined
    return fn(t["x"], t["dt"], t["A"], t["B"], t["C"], Q, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)


def run_fla(t, Q):
    from ssdiff.sides import upstream
    fn = upstream.fla().simple_gla.chunk_simple_gla
    x, h, g = t["x"], t["x"].shape[2], t["B"].shape[2]
    d = F.softplus(t["dt"].float() + t["dt_bias"])
    q = t["C"].repeat_interleave(h // g, dim=2)
    k = t["B"].repeat_interleave(h // g, dim=2)
    v = (x.float() * d[..., None]).to(x.dtype)
    o, _ = fn(q, k, v, g=d * t["A"], scale=1.0)
    return (o.float() + t["D"][:, None] * x.float()).to(x.dtype)


IMPLS = {"ssdiff.triton": run_ssdiff, "mamba_chunk_scan_combined": run_mamba, "fla.chunk_simple_gla": run_fla}


def traffic_bytes(shape, dtype):
    b, L, h, p, n, g = shape
    e = torch.tensor([], dtype=dtype).element_size()
    fwd = e * (2 * b * L * h * p + b * L * h + 2 * b * L * g * n)                   # x, dt, B, C in; y out
    bwd = e * (3 * b * L * h * p + 2 * b * L * h + 4 * b * L * g * n)               # x, dy in, dx out; dt, ddt; B, C, dB, dC
    return fwd, fwd + bwd


def oracle_error(t, outs: dict, Q, groups: int):
    """Relative RMS error of each y against the float64 chunked oracle, on the heads of the first groups."""
    from ssdiff.truth.chunked import scan
    h, g = t["x"].shape[2], t["B"].shape[2]
    hg = (h // g) * min(groups, g)
    gg = min(groups, g)
    sl = lambda v: v[:, :, :hg].double()
    ref = scan(sl(t["x"]), sl(t["dt"]), t["A"][:hg].double(), t["B"][:, :, :gg].double(),
               t["C"][:, :, :gg].double(), chunk_size=Q, D=t["D"][:hg].double(), dt_bias=t["dt_bias"][:hg].double(),
               dt_softplus=True).y
    errs = {}
    for name, y in outs.items():
        d = y[:, :, :hg].double() - ref
        errs[name] = (d.norm() / ref.norm()).item()
    del ref
    return errs


def spread(values):
    """(median, min, max) of a list of milliseconds; NaNs when empty (the pass did not run)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    v = sorted(values)
    return v[len(v) // 2], v[0], v[-1]


def bench(fn, warmup=25, rep=200):
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep)


def write_markdown(path, head, rounds, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# SSD kernel benchmark\n\n{head}\n\n")
        f.write(f"Timings: median of {rounds} interleaved rounds, each a do_bench median; [min-max] over the "
                "rounds.\n\n")
        f.write("| (b, L, h, p, n, g) | implementation | fwd ms | fwd+bwd ms | rel. RMS err of y vs fp64 | "
                "traffic bound fwd ms | traffic bound fwd+bwd ms |\n|---|---|---|---|---|---|---|\n")
        for shape, name, ms_f, ms_a, err, lb_f, lb_a, (lo_f, hi_f), (lo_a, hi_a) in rows:
            f.write(f"| {shape} | {name} | {ms_f:.3f} [{lo_f:.3f}-{hi_f:.3f}] | {ms_a:.3f} [{lo_a:.3f}-{hi_a:.3f}] "
                    f"| {err:.2e} | {lb_f:.3f} | {lb_a:.3f} |\n")


def retune() -> int:
    """Forget every Triton autotuner's choice (ssdiff's, mamba_ssm's, fla's), so each shape is tuned for itself.

    Their keys hold the tile dimensions (chunk size, headdim, dstate), not batch, length or heads: without
    this, every shape of a run would use the configs tuned at its first shape. Returns how many were reset."""
    import gc
    import warnings
    from triton.runtime.autotuner import Autotuner
    with warnings.catch_warnings():       # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        tuners = [obj for obj in gc.get_objects() if isinstance(obj, Autotuner)]
    for tuner in tuners:
        tuner.cache.clear()
    return len(tuners)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", help="b,L,h,p,n,g (default: the five of issue 7)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the lower bound")
    ap.add_argument("--error-groups", type=int, default=1, help="groups whose heads the oracle error covers")
    ap.add_argument("--impls", nargs="*", default=list(IMPLS))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per pass (median reported)")
    ap.add_argument("--markdown", help="also write the table (with date, versions, GPU) to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ssdiff.tools.kernel_benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from ssdiff import runtime
    runtime.configure()
    import triton
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    dtype = DTYPES[args.dtype]
    Q = args.chunk_size
    dev = "cuda"
    versions = [f"torch {torch.__version__}", f"triton {triton.__version__}", f"python {platform.python_version()}"]
    for label, get in (("mamba-ssm", lambda: __import__("ssdiff.sides.upstream", fromlist=["x"]).mamba_ssm().version),
                       ("fla-core", lambda: __import__("ssdiff.sides.upstream", fromlist=["x"]).fla().version)):
        try:
            versions.append(f"{label} {get()}")
        except Exception as err:  # noqa: BLE001 - report and go on
            versions.append(f"{label} unavailable ({type(err).__name__}: {err})")
    head = (f"{datetime.date.today().isoformat()} | {torch.cuda.get_device_name()} | {args.dtype} | chunk {Q} | "
            + ", ".join(versions))
    print(head)
    rows = []
    for shape in shapes:
        retune()
        t, dy = make_inputs(shape, dtype, dev)
        fwd_b, all_b = traffic_bytes(shape, dtype)
        lb_f, lb_a = fwd_b / args.bandwidth * 1e3, all_b / args.bandwidth * 1e3
        outs, runners = {}, {}
        for name in args.impls:
            fn = IMPLS[name]
            try:                                   # each pass on its own: a refused backward keeps the forward
                with torch.no_grad():
                    outs[name] = fn(t, Q)           # (autotuning happens here and in the first fwd_bwd)
                runners[name] = {"fwd": (lambda fn=fn: fn(t, Q))}
                leaves = {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}

                def fwd_bwd(fn=fn, leaves=leaves):
                    torch.autograd.backward(fn(leaves, Q), dy)

                fwd_bwd()
                runners[name]["fwd+bwd"] = fwd_bwd
            except Exception as err:  # noqa: BLE001
                print(f"  {name} failed at {shape} ({'forward+backward' if name in runners else 'forward'}): "
                      f"{type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
            torch.cuda.empty_cache()
        # rounds interleave the implementations, so a drift of the clock or temperature hits them alike
        samples = {name: {"fwd": [], "fwd+bwd": []} for name in args.impls}
        for _ in range(args.rounds):
            for name, passes in runners.items():
                with torch.no_grad():
                    samples[name]["fwd"].append(bench(passes["fwd"]))
                if "fwd+bwd" in passes:
                    samples[name]["fwd+bwd"].append(bench(passes["fwd+bwd"], rep=300))
        timings = {name: tuple(spread(samples[name][k]) for k in ("fwd", "fwd+bwd")) for name in args.impls}
        errs = oracle_error(t, outs, Q, args.error_groups) if outs else {}
        for name in args.impls:
            (ms_f, lo_f, hi_f), (ms_a, lo_a, hi_a) = timings[name]
            row = (shape, name, ms_f, ms_a, errs.get(name, float("nan")), lb_f, lb_a, (lo_f, hi_f), (lo_a, hi_a))
            rows.append(row)
            print(f"{str(shape):32s} {name:26s} fwd {ms_f:8.3f} ms [{lo_f:.3f}-{hi_f:.3f}]  fwd+bwd {ms_a:8.3f} ms "
                  f"[{lo_a:.3f}-{hi_a:.3f}]  rel.err(y) {row[4]:.2e}  bound fwd {lb_f:.3f} ms  fwd+bwd {lb_a:.3f} ms",
                  flush=True)
        del t, dy, outs, runners
        torch.cuda.empty_cache()
        if args.markdown:                          # after every shape: a run cut short keeps what it measured
            write_markdown(args.markdown, head, args.rounds, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
