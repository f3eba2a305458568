"""Where the time goes, and which tile sizes win: a GPU tool for kernel work (not a test, not the benchmark).

    python -m ssdiff.tools.kernel_tune --shape 2,16384,128,64,128,8 --dtype bfloat16 --profile
    python -m ssdiff.tools.kernel_tune --shape 2,16384,128,64,128,8 --wide --json tuned.json

--profile: one forward and one forward+backward of ssdiff's kernels and of mamba_chunk_scan_combined under
           torch.profiler; prints each GPU kernel's time per call (ms), summed over its launches.
--wide:    replaces every ssdiff kernel's autotune list by a wide grid of tile sizes, warps and stages
           (WIDE below), compiles the grid in parallel worker processes (one config index each, through
           ssdiff.runtime.autotune(index)), then lets triton's autotuner benchmark every config of every
           kernel at this shape and prints, per kernel, the best configs and their times. --json writes them.

Inputs as ssdiff.tools.kernel_benchmark (Mamba-2-like: D per head, dt_bias, softplus; chunk 256).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch


def _grid(names, values, warps=(4, 8), stages=(2, 3)):
    import triton
    out = []
    for combo in itertools.product(*values, warps, stages):
        kw = dict(zip(names, combo[:len(names)]))
        out.append(triton.Config(kw, num_warps=combo[-2], num_stages=combo[-1]))
    return out


def wide() -> dict:
    """Candidate configs per kernel name of ssdiff.kernels.ssd.configs (sized for Q=256, p=64, n=128 and near)."""
    import triton
    return {
        "cumsum": [triton.Config({"BH": bh}, num_warps=w) for bh in (4, 8, 16, 32) for w in (1, 2, 4)],
        "bmm": _grid(("BM", "BN", "BK"), ((64, 128), (64, 128), (32, 64, 128)), stages=(2, 3, 4)),
        "chunk_state": _grid(("BP", "BN", "BK"), ((32, 64), (64, 128), (32, 64, 128))),
        "bwd_dstates": _grid(("BP", "BN", "BK"), ((32, 64), (64, 128), (32, 64, 128))),
        "state_passing": [triton.Config({"BS": bs}, num_warps=w) for bs in (128, 256, 512, 1024, 2048)
                          for w in (1, 2, 4, 8)],
        "bwd_state_passing": [triton.Config({"BS": bs}, num_warps=w) for bs in (128, 256, 512, 1024, 2048)
                              for w in (1, 2, 4, 8)],
        "chunk_scan": _grid(("BM", "BP", "BK", "BN"), ((64, 128), (32, 64), (32, 64), (64, 128))),
        "bwd_dcb_ddA": _grid(("BM", "BN", "BP"), ((32, 64, 128), (32, 64), (32, 64))),
        "bwd_dbc": _grid(("BM", "BN", "BK", "BP"), ((64, 128), (64, 128), (32, 64), (32, 64))),
        "bwd_dx": _grid(("BM", "BP", "BK", "BN"), ((64, 128), (32, 64), (32, 64), (64, 128))),
        "bwd_cumsum": [triton.Config({"BH": bh}, num_warps=w) for bh in (4, 8, 16, 32) for w in (1, 2, 4)],
    }


def install_wide() -> int:
    from ssdiff.kernels.ssd import configs
    import ssdiff.kernels.ssd.combined  # noqa: F401 - registers every tuner (forward and backward)
    grids = wide()
    for name, tuners in configs.TUNERS.items():
        if name in grids:
            for t in tuners:
                t.configs = list(grids[name])
    return max(len(v) for v in grids.values())


# the implementations as ssdiff.tools.kernel_benchmark runs them (same inputs, same arguments)
BENCH_NAMES = {"ssdiff": "ssdiff.triton", "mamba": "mamba_chunk_scan_combined"}


def fwd_bwd(t, dy, Q, impl="ssdiff"):
    from ssdiff.tools.kernel_benchmark import IMPLS
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}
    y = IMPLS[BENCH_NAMES[impl]](leaves, Q)
    torch.autograd.backward(y, dy)
    return y


def forward(t, Q, impl="ssdiff"):
    from ssdiff.tools.kernel_benchmark import IMPLS
    with torch.no_grad():
        return IMPLS[BENCH_NAMES[impl]](t, Q)


def profile(t, dy, Q, iters=3) -> None:
    """Per-kernel GPU time of ``iters`` calls of each pass, and its spread over the launches (a kernel whose
    launches vary shows a wide min-max: the suspect when whole-pass timings are bimodal)."""
    from torch.profiler import ProfilerActivity, profile as prof
    for impl in ("ssdiff", "mamba"):
        for label, fn in (("forward", lambda: forward(t, Q, impl)), ("forward+backward", lambda: fwd_bwd(t, dy, Q, impl))):
            fn()
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(iters):
                    fn()
                torch.cuda.synchronize()
            launches = {}                  # kernel name -> the GPU time of each launch (ms)
            for e in p.events():
                if str(getattr(e, "device_type", "")).endswith("CUDA"):
                    dev = getattr(e, "device_time_total", 0) or e.time_range.elapsed_us()
                    launches.setdefault(e.name, []).append(dev / 1e3)
            rows = sorted(((sum(v) / iters, len(v) // iters, sorted(v), k) for k, v in launches.items()),
                          reverse=True)
            total = sum(r[0] for r in rows)
            print(f"\n## {impl} {label}: {total:.3f} ms of GPU kernels per call ({iters} calls; per launch: "
                  "min / median / max ms)")
            for ms, n, v, key in rows[:25]:
                print(f"  {ms:8.3f} ms  x{n:<3d} {v[0]:.3f} / {v[len(v) // 2]:.3f} / {v[-1]:.3f}  {key[:90]}")


MAMBA_CONFIGS = 12    # mamba_ssm's kernels have at most 11 autotune configs


def worker(index: int, stride: int, count: int, t, dy, Q, mamba: bool) -> None:
    """Compile (and run once) config ``i`` of every kernel, for i = index, index + stride, ... < count."""
    from ssdiff import runtime
    for i in range(index, count, stride):
        for impl in ("ssdiff", "mamba") if mamba and i < MAMBA_CONFIGS else ("ssdiff",):
            try:
                with runtime.autotune(i):
                    fwd_bwd(t, dy, Q, impl)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - a config that does not fit is the tuner's business
                print(f"worker {index}: {impl} config index {i}: {type(err).__name__}: {str(err)[:200]}", flush=True)


def report(path=None) -> dict:
    from ssdiff.kernels.ssd import configs
    out = {}
    for name, tuners in configs.TUNERS.items():
        for k, tuner in enumerate(tuners):
            timings = getattr(tuner, "configs_timings", None)
            if not timings:
                continue
            ranked = sorted(((v[0] if isinstance(v, (list, tuple)) else v, str(c)) for c, v in timings.items()))
            label = name if len(tuners) == 1 else f"{name}[{k}]"
            out[label] = ranked
            print(f"\n## {label}: {len(ranked)} configs, best {ranked[0][0]:.4f} ms, worst finite "
                  f"{max(r[0] for r in ranked if r[0] != float('inf')):.4f} ms")
            for ms, cfg in ranked[:6]:
                print(f"  {ms:8.4f} ms  {cfg}")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,16384,128,64,128,8", help="b,L,h,p,n,g")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=3, help="calls per pass under --profile")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ssdiff.tools.kernel_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    from ssdiff import runtime
    from ssdiff.tools.kernel_benchmark import DTYPES, make_inputs
    runtime.configure()
    shape = tuple(int(v) for v in args.shape.split(","))
    t, dy = make_inputs(shape, DTYPES[args.dtype], "cuda")
    Q = args.chunk_size
    count = install_wide() if args.wide else MAMBA_CONFIGS
    if args.worker is not None:
        worker(args.worker, args.workers, count, t, dy, Q, mamba=args.profile)
        return 0
    # compile in parallel first: the autotuners below then only benchmark (triton's cache holds the binaries)
    start = time.time()
    flags = ["--wide"] if args.wide else []
    flags += ["--profile"] if args.profile else []
    procs = [subprocess.Popen([sys.executable, "-m", "ssdiff.tools.kernel_tune", "--shape", args.shape, "--dtype", args.dtype,
                               "--chunk-size", str(Q), "--workers", str(args.workers), "--worker", str(i), *flags])
             for i in range(min(args.workers, count))]
    for p in procs:
        p.wait()
    print(f"compiled {count} config indices in {time.time() - start:.0f} s", flush=True)
    if args.wide:
        start = time.time()
        fwd_bwd(t, dy, Q)
        forward(t, Q)
        torch.cuda.synchronize()
        print(f"autotuned in {time.time() - start:.0f} s", flush=True)
        report(args.json)
    if args.profile:
        profile(t, dy, Q, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
