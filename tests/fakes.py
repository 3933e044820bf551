"""Small fakes shared by tests of different packages."""

from __future__ import annotations


class FakeReady:
    """A KVReady marker (pdserve.kernels.kv_ready) that completes only when the test says so;
    counts its polls, so a test can wait until the code under test has looked at it."""

    def __init__(self) -> None:
        self.is_done = False
        self.num_queries = 0

    def query(self) -> bool:
        self.num_queries += 1
        return self.is_done
