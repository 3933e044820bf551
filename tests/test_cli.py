"""pdserve serve flags: the GIL switch interval a worker process runs with."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdserve.cli import DEFAULT_GIL_SWITCH_INTERVAL_MS, add_serve_args, apply_gil_switch_interval


@pytest.fixture
def restore_switch_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_serve_defaults_to_a_short_gil_switch_interval(restore_switch_interval: None) -> None:
    args = parse()
    assert args.gil_switch_interval_ms == DEFAULT_GIL_SWITCH_INTERVAL_MS < 5.0
    apply_gil_switch_interval(args.gil_switch_interval_ms)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)


def test_zero_keeps_the_interpreter_default(restore_switch_interval: None) -> None:
    sys.setswitchinterval(0.005)
    apply_gil_switch_interval(parse("--gil-switch-interval-ms", "0").gil_switch_interval_ms)
    assert sys.getswitchinterval() == pytest.approx(0.005)
