"""Compile every kernel of kernels/ssd for an NVIDIA target without a GPU (Triton -> PTX -> cubin with the
ptxas bundled in the triton wheel), under every autotune configuration, in fp32 and bf16, and report the
shared memory each needs. Catches what the interpreter cannot: compile errors of the real backend and
configurations that do not fit in shared memory.

    TRITON_INTERPRET=0 python -m ssdiff.kernels.compile_check [--arch 90] [--Q 256 --P 64 --N 128]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"          # real JITFunctions, even on a machine without a GPU

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

SMEM_LIMIT = {90: 232448, 80: 166912, 89: 101376}


def specs():
    from .ssd import bmm, chunk_scan, chunk_state, cumsum, state_passing
    f32 = "fp32"
    return {  # config name -> (kernel, pointer dtypes ("act" = activation dtype), constexprs)
        "cumsum": (cumsum.ssd_fwd_kernel_cumsum, dict(dt="act", A=f32, dt_bias=f32, dt_out=f32, dA_cs=f32),
                   dict(DT_SOFTPLUS=True, HAS_DT_BIAS=True, BQ=256)),
        "bmm": (bmm.ssd_fwd_kernel_bmm, dict(C="act", B="act", CB=f32), {}),
        "chunk_state": (chunk_state.ssd_kernel_chunk_state, dict(X="act", Bm="act", dt_out=f32, dA_cs=f32,
                                                                 seq_idx="i32", S=f32), dict(MODE=0, HAS_SEQ_IDX=True, IDX64=False)),
        "bwd_dstates": (chunk_state.ssd_kernel_chunk_state, dict(X=f32, Bm="act", dt_out=f32, dA_cs=f32,
                                                                 seq_idx="i32", S=f32), dict(MODE=1, HAS_SEQ_IDX=True, IDX64=True)),
        "varlen_states": (chunk_state.ssd_fwd_kernel_varlen_states,
                          dict(X="act", Bm="act", dt_out=f32, dA_cs=f32, seq_idx="i32", passed=f32,
                               cu_seqlens="i32", out=f32), {}),
        "state_passing": (state_passing.ssd_fwd_kernel_state_passing,
                          dict(S=f32, dA_cs=f32, seq_idx="i32", initial_states=f32, passed=f32, final=f32),
                          dict(HAS_SEQ_IDX=True, HAS_INITIAL_STATES=True)),
        "bwd_state_passing": (state_passing.ssd_bwd_kernel_state_passing,
                              dict(dH_out=f32, passed=f32, dA_cs=f32, seq_idx="i32", dfinal=f32, dS=f32,
                                   dinitial=f32, dkeep=f32),
                              dict(HAS_SEQ_IDX=True, HAS_DFINAL=True, HAS_INITIAL_STATES=True)),
        "chunk_scan": (chunk_scan.ssd_fwd_kernel_chunk_scan,
                       dict(x="act", C="act", CB=f32, dt_out=f32, dA_cs=f32, passed=f32, seq_idx="i32", D=f32,
                            z="act", out="act", scan_out=f32, pregate_out="act"),
                       dict(HAS_SEQ_IDX=True, HAS_D=True, D_PER_CHANNEL=False, HAS_Z=True, STORE_SCAN=True,
                            STORE_PREGATE=True, IDX64=True)),
        "bwd_gate": (chunk_scan.ssd_bwd_kernel_gate, dict(dy="act", z="act", o="act", ds=f32, dz="act"), {}),
        "bwd_dcb_ddA": (chunk_scan.ssd_bwd_kernel_dcb_ddA,
                        dict(x="act", ds="act", CB=f32, dt_out=f32, dA_cs=f32, seq_idx="i32", dCB=f32,
                             ddA_part=f32, run=f32), dict(HAS_SEQ_IDX=True)),
        "bwd_dbc": (bmm.ssd_bwd_kernel_dbc, dict(U=f32, V="act", W="act", dCB=f32, dt_out=f32, dA_cs=f32,
                                                 seq_idx="i32", states=f32, out="act", dcs_part=f32),
                    dict(IS_DC=True, HAS_SEQ_IDX=True)),
        "bwd_dx": (chunk_scan.ssd_bwd_kernel_dx,
                   dict(x="act", ds=f32, Bm="act", CB=f32, dt_out=f32, dA_cs=f32, seq_idx="i32", dS=f32, D=f32,
                        dx="act", ddt_part=f32, dD_part=f32), dict(HAS_SEQ_IDX=True, HAS_D=True, D_PER_CHANNEL=True)),
        "bwd_cumsum": (cumsum.ssd_bwd_kernel_cumsum,
                       dict(dt="act", A=f32, dt_bias=f32, dcs=f32, T=f32, ddA_in=f32, ddt_in=f32, ddt="act",
                            dA_part=f32, ddt_bias_part=f32), dict(DT_SOFTPLUS=True, HAS_DT_BIAS=True, BQ=256)),
    }


def _jit(k):
    while not isinstance(k, triton.runtime.jit.JITFunction):
        k = k.fn
    return k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--Q", type=int, default=256)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--N", type=int, default=128)
    ap.add_argument("--H", type=int, default=64)
    args = ap.parse_args(argv)
    from .ssd import configs
    target = GPUTarget("cuda", args.arch, 32)
    limit = SMEM_LIMIT.get(args.arch, 232448)
    dims = dict(Q=args.Q, P=args.P, N=args.N, H=args.H, PN=args.P * args.N)
    failures = 0
    for name, (kernel, ptrs, consts) in specs().items():
        fn = _jit(kernel)
        for index, cfg in enumerate(configs.fitter(name)(configs.CONFIGS[name][0], dims)):
            for act in ("fp32", "bf16"):
                cx, sig = {}, {}
                values = dict(consts, **cfg.kwargs)
                for i, arg in enumerate(fn.arg_names):
                    if arg in values:
                        sig[arg], cx[(i,)] = "constexpr", values[arg]
                    elif arg in ptrs:
                        sig[arg] = "*" + (act if ptrs[arg] == "act" else ptrs[arg])
                    else:
                        sig[arg] = "i32"
                try:
                    out = triton_compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=target,
                                         options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
                    shared = out.metadata.shared
                    status = "ok" if shared <= limit else "TOO MUCH SHARED MEMORY"
                    failures += shared > limit
                except Exception as err:  # noqa: BLE001 - report every kernel
                    status, shared = f"FAILED: {type(err).__name__}: {str(err)[:300]}", -1
                    failures += 1
                print(f"{name:18s} config {index} {act:5s} shared {shared:7d} B  {status}", flush=True)
    print("all kernels compile" if not failures else f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
