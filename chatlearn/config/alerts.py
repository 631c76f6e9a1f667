"""Alerts on a run's metrics (``runtime.alerts``, `chatlearn deploy --alert-on`): ``METRIC OP NUMBER [for N
episodes]``, e.g. ``reward_mean < 0.1 for 3 episodes``.

The run checks each alert against every episode's row (`Alerts.update`): N rows in a row that have the metric
and meet the condition fire it once, as the Prefect event ``chatlearn.alert`` (resource
``chatlearn.alert.<exp_name>.<alert's slug>``, labelled with the alert's text; related: the run, its train flow
run and its deployment) and a line on the terminal; a row that does not meet it starts the count again, rows
without the metric (an eval metric between evals) leave it as it is. A resumed run replays the rows it keeps, so
an alert fires as in the uninterrupted run. `flows.deployments.alert_automation` turns the event into an action.
"""

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ALERT", "Alert", "Alerts", "parse_alert"]

ALERT = "chatlearn.alert"

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}
_PATTERN = re.compile(r"^\s*([A-Za-z_][\w/.]*)\s*(<=|>=|==|!=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
                      r"(?:\s+for\s+(\d+)\s+episodes?)?\s*$")


@dataclass(frozen=True)
class Alert:
    text: str
    metric: str
    op: str
    value: float
    episodes: int = 1

    @property
    def slug(self) -> str:
        """The alert as a resource id's last part: lowercase letters, digits and dashes."""
        words = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
        raw = f"{self.metric}-{words[self.op]}-{self.value:g}-for-{self.episodes}"
        return re.sub(r"[^a-z0-9.-]+", "-", raw.lower()).strip("-")

    def holds(self, row: dict[str, Any]) -> bool | None:
        """Whether ``row`` meets the condition (None: the row has no such metric)."""
        got = row.get(self.metric)
        if not isinstance(got, int | float) or isinstance(got, bool):
            return None
        return _OPS[self.op](float(got), self.value)


def parse_alert(text: str) -> Alert:
    """``METRIC OP NUMBER [for N episodes]``; a ValueError saying the form otherwise."""
    found = _PATTERN.match(text)
    if found is None or (found[4] is not None and int(found[4]) < 1):
        raise ValueError(f"{text!r} is not an alert: METRIC OP NUMBER [for N episodes], OP one of "
                         f"{' '.join(_OPS)}, e.g. 'reward_mean < 0.1 for 3 episodes'")
    return Alert(text=text.strip(), metric=found[1], op=found[2], value=float(found[3]),
                 episodes=int(found[4] or 1))


class Alerts:
    """The run's alerts and how many rows in a row met each."""

    def __init__(self, texts: list[str]) -> None:
        self.alerts = [parse_alert(t) for t in texts]
        self.streak = [0] * len(self.alerts)
        self.since = [0] * len(self.alerts)  # the episode each streak began at (counted from 1)

    def update(self, row: dict[str, Any]) -> list[tuple[Alert, list[int]]]:
        """The alerts ``row`` (one episode's, ``episode`` counted from 1) fires: each with the episodes of its
        streak."""
        fired = []
        for i, alert in enumerate(self.alerts):
            held = alert.holds(row)
            if held is None:
                continue
            if not held:
                self.streak[i] = 0
                continue
            if self.streak[i] == 0:
                self.since[i] = row["episode"]
            self.streak[i] += 1
            if self.streak[i] == alert.episodes:  # once per streak
                fired.append((alert, list(range(self.since[i], row["episode"] + 1))))
        return fired
