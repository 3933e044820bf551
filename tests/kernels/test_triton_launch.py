"""The extend kernel's launch configuration per device (no GPU needed: a pure choice)."""

from __future__ import annotations

import torch

from pdserve.kernels.triton.extend import SMALL_BLOCK, LaunchConfig, launch_config


def test_hopper_with_16_bit_operands_spreads_64_by_64_tiles_over_8_warps_one_stage() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        assert launch_config(128, dtype, (9, 0)) == LaunchConfig(64, 64, 8, 1)
        assert launch_config(64, dtype, (9, 0)) == LaunchConfig(64, 64, 8, 1)


def test_float32_older_gpus_big_heads_and_the_interpreter_keep_smaller_tiles() -> None:
    assert launch_config(128, torch.float32, (9, 0)) == LaunchConfig(64, 64, 4, None)
    assert launch_config(128, torch.bfloat16, (8, 0)) == LaunchConfig(64, 64, 4, None)
    small = LaunchConfig(SMALL_BLOCK, SMALL_BLOCK, 4, None)
    assert launch_config(256, torch.bfloat16, (9, 0)) == small
    assert launch_config(128, torch.bfloat16, None) == small
