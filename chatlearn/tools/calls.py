"""Tool calls in generated text, and tool results as the observation text the model reads next.

The format is the Hermes / Qwen2.5 / Qwen3 chat templates' one: the assistant writes

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+2"}}
    </tool_call>

one block per call, several per turn allowed, and each result comes back wrapped as

    <tool_response>
    4
    </tool_response>

(the templates render a ``{"role": "tool", "content": ...}`` message that way; `tool_message` builds that
message, `render_tool_response` the raw text for a rollout that appends tokens without a template).

A call that cannot be run (bad JSON, no name, an unknown tool, missing, unexpected or mistyped arguments, an
unclosed block) is a `CallError` whose ``observation`` tells the model what was wrong: parsing never raises.
"""

import dataclasses
import json
import re
from collections.abc import Mapping

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|(?=" + re.escape(CALL_OPEN)
                    + r")|\Z)", re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    raw: str


@dataclasses.dataclass(frozen=True)
class CallError:
    message: str
    raw: str

    @property
    def observation(self) -> str:
        return f"Error: {self.message}"


def _type_ok(value, expected: str | list) -> bool:
    names = expected if isinstance(expected, list) else [expected]
    for name in names:
        py = _JSON_TYPES.get(name)
        if py is None:
            return True  # a type this checker does not know: let the tool judge
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


def check_arguments(name: str, arguments: dict, parameters: Mapping) -> str | None:
    """What is wrong with the arguments for a tool whose JSON schema is ``parameters`` (None: nothing)."""
    props = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"tool '{name}' is missing required argument(s) {', '.join(map(repr, missing))}"
    if parameters.get("additionalProperties", True) is False:
        extra = [a for a in arguments if a not in props]
        if extra:
            return (f"tool '{name}' has no argument(s) {', '.join(map(repr, extra))}; "
                    f"its arguments are {', '.join(map(repr, props)) or 'none'}")
    for arg, value in arguments.items():
        expected = props.get(arg, {}).get("type")
        if expected is not None and not _type_ok(value, expected):
            return f"tool '{name}' argument '{arg}' must be of type {expected}, got {type(value).__name__}"
    return None


def parse_call(body: str, tools: Mapping[str, Mapping] | None = None) -> ToolCall | CallError:
    """One block's JSON as a call; ``tools`` maps each name to its parameters' JSON schema (None: any name)."""
    raw = body.strip()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        return CallError(f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); write "
                         '{"name": <tool name>, "arguments": {...}} inside <tool_call></tool_call>', raw)
    if not isinstance(data, dict):
        return CallError(f"the tool call must be a JSON object, got {type(data).__name__}", raw)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return CallError('the tool call has no "name" (a string naming the tool)', raw)
    if tools is not None and name not in tools:
        return CallError(f"unknown tool '{name}'; the tools are {', '.join(map(repr, tools)) or 'none'}", raw)
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return CallError(f"the arguments of '{name}' are a string that is not a JSON object", raw)
    if not isinstance(arguments, dict):
        return CallError(f'the "arguments" of \'{name}\' must be a JSON object, got {type(arguments).__name__}',
                         raw)
    extra = sorted(set(data) - {"name", "arguments"})
    if extra:
        return CallError(f"the tool call has unexpected key(s) {', '.join(map(repr, extra))}; "
                         'only "name" and "arguments"', raw)
    if tools is not None:
        problem = check_arguments(name, arguments, tools[name])
        if problem:
            return CallError(problem, raw)
    return ToolCall(name, arguments, raw)


def parse_tool_calls(text: str, tools: Mapping[str, Mapping] | None = None) -> list[ToolCall | CallError]:
    """Every ``<tool_call>`` block in the text, in order; an unclosed block is a CallError."""
    found: list[ToolCall | CallError] = []
    for match in _BLOCK.finditer(text):
        body = match.group(1)
        if not match.group(0).endswith(CALL_CLOSE):
            found.append(CallError(f"a {CALL_OPEN} block is not closed with {CALL_CLOSE}", body.strip()))
            continue
        found.append(parse_call(body, tools))
    return found


def has_tool_calls(text: str) -> bool:
    return CALL_OPEN in text


def render_tool_response(content: str) -> str:
    """A tool's result as the templates show it to the model."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def tool_message(content: str, name: str | None = None) -> dict:
    """A tool's result as a chat message for ``apply_chat_template`` (the template adds the wrapping)."""
    message = {"role": "tool", "content": content}
    if name is not None:
        message["name"] = name
    return message
