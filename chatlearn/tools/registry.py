"""Tools by name: their descriptions for a chat template's ``tools=`` and one ``call`` that never raises."""

import dataclasses
from collections.abc import Callable, Mapping

from chatlearn.tools.calculator import calculate
from chatlearn.tools.calls import CallError, check_arguments, parse_tool_calls
from chatlearn.tools.sandbox import Sandbox


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., str]  # the arguments as keywords -> observation text

    def schema(self) -> dict:
        """The OpenAI-style function description chat templates take in ``tools=``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                {"type": "object", "properties": {"expression": {"type": "string",
                                                                 "description": "e.g. (3 + 4) * 2 ** 3"}},
                 "required": ["expression"], "additionalProperties": False},
                calculate)


def python_tool(sandbox: Sandbox | None = None) -> Tool:
    box = sandbox or Sandbox()

    def run(code: str) -> str:
        return box.run(code).observation()

    return Tool("python", "Run a Python program (standard library only, no network, no files but its own "
                "working directory) and return what it prints. Print the values you need.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                 "required": ["code"], "additionalProperties": False},
                run)


class ToolRegistry:
    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def parameters(self) -> Mapping[str, dict]:
        return {name: t.parameters for name, t in self.tools.items()}

    def call(self, name: str, arguments: dict) -> str:
        """The observation text of one call; a bad call or a failing tool is an ``Error: ...`` text."""
        tool = self.tools.get(name)
        if tool is None:
            return f"Error: unknown tool '{name}'; the tools are {', '.join(map(repr, self.tools)) or 'none'}"
        if not isinstance(arguments, dict):
            return f"Error: the arguments of '{name}' must be a JSON object"
        problem = check_arguments(name, arguments, tool.parameters)
        if problem:
            return f"Error: {problem}"
        try:
            return tool.fn(**arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, not the rollout's
            return f"Error: tool '{name}' failed: {type(e).__name__}: {e}"

    def observe(self, text: str) -> list[str]:
        """One observation per ``<tool_call>`` block in a generated turn, in order (errors included)."""
        return [c.observation if isinstance(c, CallError) else self.call(c.name, c.arguments)
                for c in parse_tool_calls(text, self.parameters())]


def default_registry(sandbox: Sandbox | None = None) -> ToolRegistry:
    """The built-in tools: ``calculator`` and ``python``."""
    return ToolRegistry([calculator_tool(), python_tool(sandbox)])
