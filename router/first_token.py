"""What the router predicts of a prompt's time to first token on a worker that could
prefill it: seconds per prompt token queued there, learned from that worker's first
tokens (FirstTokenTimes), and the queue its recent prompts build at their arrival
rate (an M/G/1 queue's mean wait, Pollaczek-Khinchine). router/placement.py chooses who
prefills by these under SLOs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .workers import Worker


@dataclass(frozen=True)
class Eta:
    """Predicted seconds to the first token of one prompt sent now to one worker.

    - `now`: with the prompt tokens queued there now (the worker's line at queued +
      this prompt's tokens);
    - `steady`: with the queue the worker's recent prompts build at their arrival rate:
      this prompt's compute, plus the mean wait of an M/G/1
      queue, lam E[S^2] / (2 (1 - rho)) (Pollaczek-Khinchine; lam prompts a second,
      S a prompt's compute in seconds, rho = lam E[S] the worker's utilisation by
      prefills); inf at rho >= 1, where the queue grows without bound;
    - `rho`: that utilisation.
    """

    now: float
    steady: float
    rho: float

    @property
    def seconds(self) -> float:
        """The later of the two: the queue there is, or the one the rate will build."""
        return max(self.now, self.steady)


class FirstTokenTimes:
    """Per worker that prefills (a prefill worker, or a decode worker for its own
    prefills), the seconds from sending it a prompt to its first token, modelled as
    proportional to the prompt tokens it had to compute for it (those queued ahead on
    it, this prompt's included): `seconds = b * tokens`, b the ratio of the first-token
    seconds to those tokens summed over its observations, each weighing DECAY times the
    next one's, so b follows the worker's load and the machine's. The router's own
    clock: the queue wait, the prefill steps, the KV transfer and the hops are all in
    b. A ratio, not a least-squares line: under load the observations sit in a narrow
    band of queue lengths where a free intercept and slope trade off (a fit of 54 s +
    1.9 ms a token was seen where the worker computed ~7 ms a token), and the slope is
    what the queue model (eta) needs; the ratio's bias, the fixed hops spread over the
    tokens, is a few percent for prompts of hundreds of tokens.

    Per worker also the prompts sent to it (`sent`), counted with weights that halve
    every RATE_WINDOW_S * ln 2 seconds: their rate and the mean and mean square of their
    tokens, for the queue they build (eta). A router counts the prompts it sent: with
    several router replicas each sees its own share of a worker's arrivals, while the
    queued tokens it is given include the others' (Worker.total_queued_tokens)."""

    DECAY = 0.95          # ~20 first tokens remembered
    LEARN = 4             # observations a worker's line needs before it predicts
    RATE_WINDOW_S = 30.0  # time constant of the arrival rate (~13 prompts of ~2.3 s)

    def __init__(self, clock=time.monotonic):
        self._lines: dict[str, tuple[int, float, float]] = {}    # n, tokens, seconds
        self._sent: dict[str, tuple[float, float, float, float]] = {}   # t, n, sum, sum sq
        self._clock = clock

    def observe(self, worker_id: str, tokens: int, seconds: float) -> None:
        """A prompt sent to `worker_id` with `tokens` prompt tokens queued there (its
        own included) had its first token back after `seconds`."""
        n, x, y = self._lines.get(worker_id, (0, 0.0, 0.0))
        self._lines[worker_id] = n + 1, x * self.DECAY + tokens, y * self.DECAY + seconds

    def seconds_per_token(self, worker_id: str) -> float | None:
        """b of the worker's line, seconds per queued prompt token (`worker_id` a line
        key: FirstTokenTimes.line); None before LEARN observations."""
        n, x, y = self._lines.get(worker_id, (0, 0.0, 0.0))
        return None if n < self.LEARN or x <= 0 else y / x

    def sent(self, worker_id: str, tokens: int) -> None:
        """A prompt of `tokens` tokens was sent to `worker_id` to prefill."""
        now = self._clock()
        n, s, ss = self._decayed(worker_id, now)
        self._sent[worker_id] = now, n + 1, s + tokens, ss + tokens * tokens

    def _decayed(self, worker_id: str, now: float) -> tuple[float, float, float]:
        t, n, s, ss = self._sent.get(worker_id, (now, 0.0, 0.0, 0.0))
        f = math.exp(-(now - t) / self.RATE_WINDOW_S)
        return n * f, s * f, ss * f

    def arrivals(self, worker_id: str) -> tuple[float, float, float]:
        """(prompts a second, mean tokens, mean squared tokens) of the prompts sent to
        `worker_id` lately (weights decaying with time constant RATE_WINDOW_S); zeros
        when none was."""
        n, s, ss = self._decayed(worker_id, self._clock())
        return (0.0, 0.0, 0.0) if n <= 0 else (n / self.RATE_WINDOW_S, s / n, ss / n)

    def eta(self, line: str, worker_id: str, queued: int, tokens: int) -> Eta | None:
        """The first token of a `tokens`-token prompt sent now to the worker `worker_id`
        (the prompts it was sent make its arrival rate), predicted by its line `line`
        (FirstTokenTimes.line) with `queued` prompt tokens queued there now; None
        before the line has LEARN observations."""
        b = self.seconds_per_token(line)
        if b is None:
            return None
        rate, mean, mean_sq = self.arrivals(worker_id)
        rho = rate * b * mean
        steady = (math.inf if rho >= 1 else
                  b * tokens + rate * b * b * mean_sq / (2 * (1 - rho)))
        return Eta(now=b * (queued + tokens), steady=steady, rho=rho)

    def state(self, line: str, worker_id: str) -> dict:
        """What eta() reads of one worker, as plain data: {"seconds_per_token": b or
        None, "arrivals": [prompts a second, mean tokens, mean squared tokens]} (for
        the router's debug log of each placement, and to replay one: from_states)."""
        return {"seconds_per_token": self.seconds_per_token(line),
                "arrivals": list(self.arrivals(worker_id))}

    @classmethod
    def from_states(cls, states: dict[tuple[str, str], dict]) -> "FirstTokenTimes":
        """FirstTokenTimes whose eta() gives what state() read: {(line, worker_id):
        state}. Its clock stands still, so the arrivals stay as recorded."""
        out = cls(clock=lambda: 0.0)
        for (line, worker_id), st in states.items():
            if (b := st["seconds_per_token"]) is not None:
                out._lines[line] = cls.LEARN, 1000.0, 1000.0 * b
            rate, mean, mean_sq = st["arrivals"]
            n = rate * cls.RATE_WINDOW_S
            out._sent[worker_id] = 0.0, n, n * mean, n * mean_sq
        return out

    def forget(self, worker_id: str) -> None:
        """Drop the worker's lines (its own, and line(w, lent=True)'s) and its arrivals."""
        for key in [k for k in self._lines if k.split("+")[0] == worker_id]:
            del self._lines[key]
        self._sent.pop(worker_id, None)

    @staticmethod
    def line(w: Worker, lent: bool = False) -> str:
        """The key of `w`'s line: a decode worker's prefills on the idle prefill
        workers' lent cores (`lent`) run faster than on its own and have their own."""
        return f"{w.worker_id}+lent" if lent else w.worker_id
