"""Compile the delta rule's (``fast-weight``) triton kernels for sm_90 without a GPU and report what ptxas says.

For each tile configuration, each of the six kernels of :mod:`attnkit_kernelized.fast_weight.triton_ops` is
compiled by triton (``triton.compile`` of an ``ASTSource`` with ``GPUTarget("cuda", 90, 32)``: no driver needed),
and its PTX is assembled with the ``ptxas-blackwell`` shipped in the triton wheel (the one triton itself uses for
sm_90 and later) with ``-v``: registers, spill stores / loads (bytes), and triton's shared-memory estimate. This is
how the tiles of ``_TILES`` were chosen (docs/kernelized-triton.md, the delta-rule section). Nothing is timed.

Usage (repository root, triton installed; a few seconds per kernel)::

    python plugins/attnkit-kernelized/benchmarks/ptxas_fast_weight.py --kind half --warps 8 --configs 64/32/32
    python plugins/attnkit-kernelized/benchmarks/ptxas_fast_weight.py --kind float32 --warps 4 8 \
        --configs 64/32/32 32/32/32

A configuration is ``C/BLOCK_K/BLOCK_E`` (chunk positions, feature block, value block). ``half``: float16 keys
and values in the forward's WY kernel (tensor-core ``K K^T``), TF32 products elsewhere, float32 buffers (the
backward of half inputs widens to float32: its kernels compile as here); ``float32``: IEEE products;
``float64``: float64 everywhere.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnkit_kernelized.fast_weight import triton_ops as T

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
TARGET = GPUTarget("cuda", 90, 32)


def report(fn, pointers: dict[str, str], consts: dict, num_warps: int) -> tuple[int | None, str, int]:
    """``(registers, 'stores/loads' spill bytes, shared bytes)`` of ``fn`` compiled with ``consts``."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w", encoding="utf-8") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else None, "/".join(spill.groups()) if spill else text.strip()[-200:],
            kernel.metadata.shared)


def kernels(kind: str, C: int, bk: int, be: int):
    """``(name, kernel, pointer dtypes, constexprs)`` of the six kernels as the wrappers launch them."""
    buf = "fp64" if kind == "float64" else "fp32"
    inp = {"half": "fp16", "float32": "fp32", "float64": "fp64"}[kind]
    prec = "tf32" if kind == "half" else "ieee"
    f64 = kind == "float64"

    def ptrs(dtype, *names):
        return {n: f"*{dtype}" for n in names}

    yield ("wy", T._wy_kernel, {**ptrs(inp, "K", "V"), **ptrs(buf, "BETA", "TM", "WB", "UB")},
           dict(BLOCK_L=C, BLOCK_K=bk, BLOCK_E=be, F64=f64, LOWP=kind == "half", PREC=prec))
    yield ("state", T._state_kernel, ptrs(buf, "K", "WB", "UB", "CK", "UN"),
           dict(BLOCK_L=C, BLOCK_K=bk, BLOCK_E=be, F64=f64, PREC=prec))
    yield ("bwd_local", T._bwd_local_kernel, ptrs(buf, "Q", "K", "DO", "DUL"),
           dict(BLOCK_L=C, BLOCK_K=bk, BLOCK_E=be, PREC=prec))
    yield ("bwd_state", T._bwd_state_kernel, ptrs(buf, "Q", "K", "WB", "DO", "DUL", "DH", "DU"),
           dict(BLOCK_L=C, BLOCK_K=bk, BLOCK_E=be, PREC=prec))
    yield ("bwd_intra", T._bwd_intra_kernel, ptrs(buf, "V", "BETA", "TM", "UN", "DO", "DU", "DR", "DPB", "ZB", "DV",
                                                  "DB"), dict(BLOCK_L=C, BLOCK_E=be, PREC=prec))
    yield ("bwd_chunk", T._bwd_chunk_kernel, ptrs(buf, "Q", "K", "BETA", "CK", "UN", "DO", "DH", "DR", "DPB", "ZB",
                                                  "DQ", "DK", "DB"), dict(BLOCK_L=C, BLOCK_K=bk, BLOCK_E=be, PREC=prec))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=("half", "float32", "float64"), default="half")
    p.add_argument("--warps", type=int, nargs="+", default=[8])
    p.add_argument("--configs", nargs="+", default=["64/32/32"], help="C/BLOCK_K/BLOCK_E")
    args = p.parse_args()
    print("| kind | C | blocks | warps | kernel | registers | spill stores/loads (B) | shared (B) |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg in args.configs:
        C, bk, be = (int(x) for x in cfg.split("/"))
        for warps in args.warps:
            for name, fn, pointers, consts in kernels(args.kind, C, bk, be):
                regs, spills, shared = report(fn, pointers, consts, warps)
                print(f"| {args.kind} | {C} | {bk} x {be} | {warps} | {name} | {regs} | {spills} | {shared} |",
                      flush=True)


if __name__ == "__main__":
    main()
