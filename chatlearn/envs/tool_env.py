"""An environment whose turns are tool calls: the policy calls tools until it answers without one."""

from typing import Any

from chatlearn.envs.base import Environment
from chatlearn.tools.calls import CallError, parse_tool_calls, render_tool_response
from chatlearn.tools.registry import ToolRegistry, calculator_tool, python_tool

__all__ = ["ToolEnvironment"]

TOOLS = {"calculator": calculator_tool, "python": python_tool}


class ToolEnvironment(Environment):
    """Each answer with ``<tool_call>`` blocks gets the tools' results (errors included: a malformed call is an
    observation saying what is wrong) and the conversation goes on; the first answer without a call is final and
    judged (`judge`, the subclass's). ``info`` counts the calls and the failed ones."""

    def __init__(self, tools: list[str] | None = None) -> None:
        names = tools or ["calculator"]
        unknown = [n for n in names if n not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; known: {sorted(TOOLS)}")
        self.registry = ToolRegistry([TOOLS[n]() for n in names])
        self.calls = 0

    def reset(self, sample: dict[str, Any]) -> None:
        self.sample = sample

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        calls = parse_tool_calls(action, self.registry.parameters())
        if not calls:
            return "", self.judge(action), True, {}
        results = [c.observation if isinstance(c, CallError) else self.registry.call(c.name, c.arguments)
                   for c in calls]
        self.calls += len(calls)
        errors = sum(isinstance(c, CallError) or r.startswith("Error:") for c, r in zip(calls, results, strict=True))
        # several results in one tool turn: each wrapped as the templates wrap one (the template wraps nothing)
        text = results[0] if len(results) == 1 else "\n".join(render_tool_response(r) for r in results)
        return text, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors}

    def judge(self, answer: str) -> float:
        """The reward of the final answer (no tool call in it)."""
        raise NotImplementedError
