"""An environment whose turns are tool calls: the policy calls tools until it answers without one."""

from typing import Any

from chatlearn.config.errors import did_you_mean
from chatlearn.envs.base import Environment
from chatlearn.tools.calls import CallError, parse_tool_calls, render_tool_response
from chatlearn.tools.registry import ToolRegistry, calculator_tool, python_tool

__all__ = ["TOOLS", "ToolEnvironment"]

# the tools an environment may name (``env_args: {tools: [...]}``), each made fresh per environment
TOOLS = {"calculator": calculator_tool, "python": python_tool}


class ToolEnvironment(Environment):
    """Tool calls until a final answer, which the subclass judges.

    An answer with ``<tool_call>`` blocks gets the tools' results as the next tool turn, reward 0, and the
    conversation goes on. Nothing raises on a bad call: a malformed one (bad JSON, unknown tool, wrong arguments,
    an unclosed block) and a tool that fails both come back as an ``Error: ...`` result saying what was wrong. One
    result is the observation as it is (the chat template wraps a tool message itself); several are each wrapped
    as ``<tool_response>`` blocks, which `chatlearn.envs.render` renders as that many tool messages. ``info``
    counts the calls and the failed ones (``tool_calls``, ``tool_errors``).

    The first answer without a call is final: ``done`` with reward ``judge(answer)``. ``self.sample`` (the reset
    sample) and the counters ``calls``, ``errors`` and ``succeeded`` (calls that ran without an error) are there
    for ``judge``."""

    def __init__(self, tools: list[str] | None = None) -> None:
        names = ["calculator"] if tools is None else list(tools)
        if problems := self.tool_problems(names):
            raise ValueError(problems[0])
        self.registry = ToolRegistry([TOOLS[n]() for n in names])
        self.sample: dict[str, Any] = {}
        self.calls = self.errors = self.succeeded = 0

    @staticmethod
    def tool_problems(names: Any) -> list[str]:
        """What is wrong with the tools ``names`` (``env_args.tools``): each unknown one, with the nearest known."""
        if not isinstance(names, list | tuple) or not names:
            return [f"tools: a tool environment needs a list of one tool or more; known: {', '.join(sorted(TOOLS))}"]
        return [f"tools: unknown tool {n!r}{did_you_mean(n, TOOLS)} (known: {', '.join(sorted(TOOLS))})"
                for n in names if n not in TOOLS]

    @classmethod
    def args_problems(cls, env_args: dict[str, Any]) -> list[str]:
        return cls.tool_problems(env_args["tools"]) if "tools" in env_args else []

    def reset(self, sample: dict[str, Any]) -> None:
        self.sample = sample
        self.calls = self.errors = self.succeeded = 0

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        calls = parse_tool_calls(action, self.registry.parameters())
        if not calls:
            return "", float(self.judge(action)), True, {}
        results = [c.observation if isinstance(c, CallError) else self.registry.call(c.name, c.arguments)
                   for c in calls]
        # a tool's own failure comes back from the registry as "Error: ...", as a malformed call's does
        errors = sum(isinstance(c, CallError) or r.startswith("Error:") for c, r in zip(calls, results, strict=True))
        self.calls += len(calls)
        self.errors += errors
        self.succeeded += len(calls) - errors
        text = results[0] if len(results) == 1 else "\n".join(render_tool_response(r) for r in results)
        return text, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors}

    def judge(self, answer: str) -> float:
        """The reward of the final answer (an answer with no tool call); the subclass's to define."""
        raise NotImplementedError(f"{type(self).__name__}.judge")
