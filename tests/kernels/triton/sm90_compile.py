"""Compile the Triton attention kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs kernels as numpy code, so it accepts programs the compiler rejects (types
of loop-carried values, dot shapes, pointer arithmetic): compiling them to cubin here catches
those before any GPU time is spent. Run as a script, in a process without TRITON_INTERPRET
(kernels decorated under the interpreter cannot be compiled); prints one line per kernel, with
ptxas's register and spill counts for sm_90a where Triton bundles ptxas.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels.triton import decode, extend

CACHE_DTYPES = {"bf16": "*bf16", "fp32": "*fp32"}
CACHE_PTRS = ("q_ptr", "pool_ptr", "out_ptr")


def _signature(fn: triton.JITFunction, cache_ptr: str, constexprs: dict) -> dict[str, str]:
    """Types by argument name: the cache-dtype tensors, float32 partials, int64 metadata."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in CACHE_PTRS:
            types[name] = cache_ptr
        elif name.startswith("part_"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i64"
        elif name == "scale_log2":
            types[name] = "fp32"
        else:
            types[name] = "i64"
    return types


def ptxas_usage(ptx: str) -> str:
    """ptxas -v's register and spill line for ``ptx`` on sm_90a ("" without a ptxas)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        # Triton bundles two; the older one refuses newer PTX versions.
        for ptxas in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas"):
            if not ptxas.exists():
                continue
            cmd = [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", os.devnull]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            regs = re.search(r"Used (\d+) registers", proc.stderr)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
            if regs and spills:
                return (f" ({regs.group(1)} registers, {spills.group(1)} / {spills.group(2)} "
                        "bytes spilled)")  # fmt: skip
    return ""


def compile_kernel(
    fn: triton.JITFunction, dtype: str, constexprs: dict, options: dict | None = None
) -> None:
    signature = _signature(fn, CACHE_DTYPES[dtype], constexprs)
    by_index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=by_index)
    options = options or {"num_warps": 4}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    usage = ptxas_usage(kernel.asm["ptx"])
    print(f"{fn.__name__} {dtype} {constexprs} {options}: compiled{usage}")


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    shape = {"GROUP": 4, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_D": 128}
    # bf16 with a window (the superset of the code), float32 with exact dots, no window.
    for dtype, precision, window in (("bf16", "tf32", True), ("fp32", "ieee", False)):
        common = {**shape, "PRECISION": precision, "UPCAST": False, "HAS_WINDOW": window}
        compile_kernel(decode._decode_split_kernel, dtype, {
            **common, "NUM_SPLITS": 8, "BLOCK_H": 16, "BLOCK_N": decode.BLOCK_N,
        })  # fmt: skip
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        cfg = extend.launch_config(128, torch_dtype, (9, 0))  # what an H100/H200 launches
        options = {"num_warps": cfg.num_warps}
        if cfg.num_stages is not None:
            options["num_stages"] = cfg.num_stages
        compile_kernel(extend._extend_kernel, dtype, {
            **common, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        }, options)  # fmt: skip
    for splits in (1, 16):
        compile_kernel(decode._decode_merge_kernel, "bf16", {
            "HEAD_DIM": 128, "NUM_SPLITS": splits, "BLOCK_D": 128,
        })  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
