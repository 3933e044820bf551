"""Quantized CPU matmul (GGUF types kept packed) vs the bf16 kernel, one model's projections.

Run: ``python bench/quant_bench.py [--rows 1,8,64,512] [--threads 2] [--reps 5] [--layers 30]``.
The weights are SmolLM2-135M's projections (hidden 576, intermediate 1536, 9 heads / 3 KV heads
of 64, vocab 49152: per layer QKV 960x576, O 576x576, gate/up 3072x576, down 576x1536, plus the
49152x576 LM head), filled with random valid blocks of each type (speed does not depend on the
values; a K-quant falls back where K is not a multiple of 256, as llama-quantize does:
Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Every path takes float32 rows and returns float32.
The paths run interleaved rep by rep (a busy machine slows all alike). Printed per path: the
sum over projections of each one's fastest rep (on a loaded machine most whole passes are
preempted somewhere, single calls of well under a millisecond often are not), the median
whole pass, in ms, and the weight bandwidth of the first figure at the packed size.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pdserve.kernels import cpu_ext, cpu_gemm, quant_gemm
from pdserve.model.quantized import QuantizedTensor

HIDDEN, INTER, VOCAB = 576, 1536, 49152
LAYER_SHAPES = [(576 + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"]
# Byte offsets of each type's f16 scales in a block (set finite; the rest is random bits).
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}
SCALE_OFFSETS |= {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# What llama-quantize writes instead of a K-quant where K is not a multiple of 256 (here every
# projection but down: hidden 576), so each K-quant column is what a real file of it holds.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedTensor:
    if type_name == "F16":
        data = rng.standard_normal((n, k), dtype=np.float32).astype(np.float16).view(np.uint8)
        return QuantizedTensor(type_name, (n, k), data)
    block, raw_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if k % block != 0:
        return random_blocks(K_QUANT_FALLBACK[type_name], n, k, rng)
    raw = rng.integers(0, 256, (n, k // block, raw_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        scale = rng.uniform(-0.02, 0.02, (n, k // block)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale[..., None].view(np.uint8)
    return QuantizedTensor(type_name, (n, k), raw.reshape(n, -1))


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return (clock() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (with --threads 1, close to the time on an idle "
        "machine when a loaded one preempts the benchmark)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    module = cpu_ext.load()
    if module is None:
        raise SystemExit("the C++ kernels are unavailable here (need AVX2 and a C++ compiler)")
    shapes = LAYER_SHAPES * args.layers + [(VOCAB, HIDDEN)]
    rng = np.random.default_rng(0)
    bf16 = [cpu_gemm.PackedDenseWeight(module, torch.randn(n, k).bfloat16()) for n, k in shapes]
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
    print("rows  " + "  ".join(f"{name:>21}" for name in paths) + "   (best / median ms, GB/s)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k) for _, k in shapes]
        # per path: ms of each projection, per rep
        times = {name: np.zeros((args.reps, len(shapes))) for name in paths}
        for rep in range(args.reps):
            for name, (fn, ws) in paths.items():
                for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
                    times[name][rep, i] = timed(lambda fn=fn, x=x, w=w: fn(x, w), clock)
        cells = []
        for name, t in times.items():
            best = t.min(axis=0).sum()  # each projection's fastest rep: preemption filtered out
            median = float(np.median(t.sum(axis=1)))
            cells.append(f"{best:7.2f} /{median:7.2f} {nbytes[name] / best / 1e6:4.0f}")
        print(f"{rows:>4}  " + "  ".join(f"{c:>21}" for c in cells))


if __name__ == "__main__":
    main()
