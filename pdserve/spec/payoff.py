"""Does speculating pay at this batch size? Measured, not assumed.

Per decode-batch size the policy keeps two throughputs, each an exponential average of steps
actually run: plain decode steps (rows / step time) and speculative steps (tokens emitted /
the time of drafting and verifying). A batch size speculates while its speculative throughput
is at least the plain one; once it is not, it runs plain steps. Either way one step in
``PROBE_EVERY`` runs the other kind, so both averages stay current (the acceptance of the
running requests changes, and a first plain step may have been a cold one). A batch size with
no plain measurement yet runs one plain step first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 32
_WEIGHT = 0.25  # of the latest step in the averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new


@dataclass
class PayoffPolicy:
    plain_tok_s: dict[int, float] = field(default_factory=dict)
    spec_tok_s: dict[int, float] = field(default_factory=dict)
    _since_probe: dict[int, int] = field(default_factory=dict)

    def should_speculate(self, num_rows: int) -> bool:
        plain = self.plain_tok_s.get(num_rows)
        if plain is None:
            return False  # measure the plain step first
        spec = self.spec_tok_s.get(num_rows)
        pays = spec is None or spec >= plain
        n = self._since_probe.get(num_rows, 0) + 1
        self._since_probe[num_rows] = n
        if n >= PROBE_EVERY:
            self._since_probe[num_rows] = 0
            return not pays  # the other kind, to re-measure it
        return pays

    def on_plain(self, num_rows: int, seconds: float) -> None:
        if seconds > 0:
            self.plain_tok_s[num_rows] = _ema(self.plain_tok_s.get(num_rows), num_rows / seconds)

    def on_spec(self, num_rows: int, seconds: float, num_emitted: int) -> None:
        if seconds > 0:
            self.spec_tok_s[num_rows] = _ema(self.spec_tok_s.get(num_rows), num_emitted / seconds)
