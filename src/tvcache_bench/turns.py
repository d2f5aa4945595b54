"""The model's turn: the seconds a rollout spends generating between two of its tool calls.

Training does not issue a rollout's calls back to back: the model reads each answer and generates its next turn
first. Work a cache does in the background (a snapshot after the answer) is free only inside that gap, so the
replay engine waits a turn before every call but a rollout's first. A turn comes from the trace where its calls
carry timestamps (`started` of the call minus `ended` of the one before), else from a distribution:

- `none`: no turns, calls back to back (the replays before turns were modelled);
- `fixed:S`: S seconds every turn;
- `lognormal:MEDIAN[:SIGMA]`: a log-normal with that median (seconds) and shape (default 0.8): most turns
  near the median, a long tail of slow ones, as a served model's generation times are;
- `realistic`: `lognormal:1:0.8`, a short reasoning turn of a served model.

Draws depend only on the seed and the call's place (epoch, rollout, call), so every strategy waits the same turns.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .traces import Trace

__all__ = ["REALISTIC", "TurnTime"]

REALISTIC = "lognormal:1:0.8"
SIGMA = 0.8  # a log-normal's shape when not given


@dataclass(frozen=True, slots=True)
class TurnTime:
    kind: str = "none"  # none, fixed or lognormal
    seconds: float = 0.0  # fixed: every turn; lognormal: the median
    sigma: float = SIGMA
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> TurnTime:
        """A `--turn-time` value (see the module docstring); `ValueError` saying what is accepted otherwise."""
        text = REALISTIC if spec == "realistic" else spec
        kind, _, rest = text.partition(":")
        try:
            numbers = [float(n) for n in rest.split(":")] if rest else []
        except ValueError:
            numbers = [-1.0]
        shapes = {"none": (0, 0), "fixed": (1, 1), "lognormal": (1, 2)}
        least, most = shapes.get(kind, (-1, -1))
        if not least <= len(numbers) <= most or any(not (n >= 0 and math.isfinite(n)) for n in numbers):
            raise ValueError(
                f"--turn-time {spec!r}: use none, fixed:SECONDS, lognormal:MEDIAN[:SIGMA] or realistic ({REALISTIC}), "
                "with numbers of zero or more"
            )
        seconds = numbers[0] if numbers else 0.0
        sigma = numbers[1] if len(numbers) > 1 else SIGMA
        return cls(kind, seconds, sigma, seed)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        shape = f":{self.sigma:g}" if self.kind == "lognormal" else ""
        return f"{self.kind}:{self.seconds:g}{shape} (seed {self.seed})"

    def before(self, trace: Trace, call: int, epoch: int, rollout: int) -> float:
        """Seconds the model takes before `trace`'s call `call` (0 before its first)."""
        if call == 0:
            return 0.0
        started, ended = trace.calls[call].started, trace.calls[call - 1].ended
        if started is not None and ended is not None:
            return max(0.0, started - ended)
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "lognormal" and self.seconds > 0:
            draw = random.Random(f"{self.seed}:{epoch}:{rollout}:{call}")
            return self.seconds * math.exp(self.sigma * draw.gauss())
        return 0.0
