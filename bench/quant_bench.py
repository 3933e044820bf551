"""Quantized CPU matmul (GGUF types kept packed) vs the bf16 kernel, one model's projections.

Run: ``python bench/quant_bench.py [--rows 1,8,64,512] [--threads 2] [--reps 5] [--layers 30]``.
The weights are SmolLM2-135M's projections (hidden 576, intermediate 1536, 9 heads / 3 KV heads
of 64, vocab 49152: per layer QKV 960x576, O 576x576, gate/up 3072x576, down 576x1536, plus the
49152x576 LM head), filled with random valid blocks of each type (speed does not depend on the
values). Every path takes float32 rows and returns float32. The paths run interleaved rep by
rep (a busy machine slows all alike); min and median ms per pass over all projections, and the
effective weight bandwidth at the packed size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pdserve.kernels import cpu_ext, cpu_gemm, quant_gemm
from pdserve.model.quantized import QuantizedTensor

HIDDEN, INTER, VOCAB = 576, 1536, 49152
LAYER_SHAPES = [(576 + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"]
# Byte offsets of each type's f16 scales in a block (set finite; the rest is random bits).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedTensor:
    if type_name == "F16":
        data = rng.standard_normal((n, k), dtype=np.float32).astype(np.float16).view(np.uint8)
        return QuantizedTensor(type_name, (n, k), data)
    block, raw_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n, k // block, raw_bytes), dtype=np.uint8)
    offsets = SCALE_OFFSETS.get(type_name, (raw_bytes - 2,))  # Q6_K: d is last
    for offset in offsets:
        scale = rng.uniform(-0.02, 0.02, (n, k // block)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale[..., None].view(np.uint8)
    return QuantizedTensor(type_name, (n, k), raw.reshape(n, -1))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu_ext.load()
    if module is None:
        raise SystemExit("the C++ kernels are unavailable here (need AVX2 and a C++ compiler)")
    shapes = LAYER_SHAPES * args.layers + [(VOCAB, HIDDEN)]
    rng = np.random.default_rng(0)
    bf16 = [cpu_gemm.PackedBF16Weight(module, torch.randn(n, k).bfloat16()) for n, k in shapes]
    paths: dict[str, tuple[Callable, list]] = {
        "bf16": (lambda x, p: p(x, None, torch.float32), bf16),
    }
    for type_name in args.types.split(","):
        packed = [
            quant_gemm.PackedQuantWeight(module, [random_blocks(type_name, n, k, rng)])
            for n, k in shapes
        ]
        paths[type_name] = (lambda x, p: p(x), packed)
    nbytes = {name: sum(w.num_bytes for w in ws) for name, (_, ws) in paths.items()}
    print(f"{len(shapes)} projections, {args.threads} threads; packed MB: "
          + ", ".join(f"{name} {b / 1e6:.0f}" for name, b in nbytes.items()))  # fmt: skip
    print("rows  " + "  ".join(f"{name:>21}" for name in paths) + "   (min / median ms, GB/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k) for _, k in shapes]
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, (fn, ws) in paths.items():
                times[name].append(timed(lambda fn=fn, ws=ws, xs=xs: one_pass(fn, xs, ws)))
        cells = [
            f"{min(t):7.2f} /{statistics.median(t):7.2f} {nbytes[name] / min(t) / 1e6:4.0f}"
            for name, t in times.items()
        ]
        print(f"{rows:>4}  " + "  ".join(f"{c:>21}" for c in cells))


def one_pass(fn: Callable, xs: list[torch.Tensor], weights: list) -> None:
    for x, w in zip(xs, weights, strict=True):
        fn(x, w)


if __name__ == "__main__":
    main()
