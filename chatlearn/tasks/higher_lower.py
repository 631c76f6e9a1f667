"""The embedded task as a game of several turns: guess the largest digit of the prompt, told "higher" or "lower".

A multi-turn environment (`runtime.task_type: agent`) on the max-digit data (`max 3 7 1 ?`, answer `7`) that
the embedded tiny Llama can play from its first episode: every answer is a guess (its first digit), and until
the guess is right the environment says ``higher`` or ``lower`` (``say a digit`` when the answer has none) and
the policy guesses again. A right guess ends the game with reward ``1 - 0.25 * (guesses - 1)`` (fewer guesses
earn more); a game that runs out of turns earns the last guess's closeness, at most 0.25. The policy so learns
from the observations it reads, which a one-turn task cannot teach.
"""

from typing import Any

from chatlearn.envs.base import Environment


class HigherLower(Environment):
    """One game per sample: the target is the record's ``answer``."""

    def __init__(self, max_guesses: int = 4) -> None:
        self.max_guesses = max_guesses

    def reset(self, sample: dict[str, Any]) -> None:
        self.target = int(sample["answer"])
        self.guesses = 0

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.guesses += 1
        text = action.strip()
        last = self.guesses >= self.max_guesses
        if not text[:1].isdigit():
            return "say a digit", 0.0, last, {}
        guess = int(text[0])
        if guess == self.target:
            return "", 1.0 - 0.25 * (self.guesses - 1), True, {}
        if last:
            return "", 0.25 * (1.0 - abs(guess - self.target) / 9.0), True, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, {}
