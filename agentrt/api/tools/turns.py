"""The tool turns of a conversation as the Responses and Messages APIs give them: each call id once,
each answer to a call its API allows (chat completions' own rules: validation.check_tool_messages).

Every check raises APIError (400) naming the request field at fault.
"""

from __future__ import annotations

import json

from agentrt.api.errors import APIError


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def add_function_call(call_ids: set[str], call_id: str, arguments: str, where: str) -> None:
    """A Responses `function_call` item (`where`: "input[i]"): its `arguments` are the JSON text of
    an object ("" for none), its `call_id` names no earlier call; the id joins `call_ids`."""
    if arguments:
        try:  # NaN / Infinity are Python's extension, not JSON (RFC 8259)
            value = json.loads(arguments, parse_constant=_not_json)
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise APIError(
                f"{where}.arguments must be the JSON text of the call's arguments object",
                param=f"{where}.arguments",
            )
    if call_id in call_ids:
        raise APIError(
            f"{where}.call_id '{call_id}' is given to an earlier function_call item: call ids are unique",
            param=f"{where}.call_id",
        )
    call_ids.add(call_id)


def check_function_call_output(call_ids: set[str], call_id: str, where: str) -> None:
    """A Responses `function_call_output` item answers a function_call item before it."""
    if call_id not in call_ids:
        raise APIError(
            f"{where}.call_id '{call_id}' answers no function_call item before it", param=f"{where}.call_id"
        )


class ToolUseIds:
    """Anthropic's rules for the tool ids of a Messages conversation: a tool_use id is given once,
    and the tool_result blocks of a user turn answer the tool_use blocks of the assistant turn just
    before it, each at most once. `new_turn` at each assistant turn, `add` each of its tool_use ids,
    `answer` each tool_result of the user turn after it."""

    def __init__(self):
        self.seen: set[str] = set()  # every tool_use id so far
        self.last: set[str] = set()  # those of the last assistant turn
        self.answered: set[str] = set()  # those of the last assistant turn answered

    def new_turn(self) -> ToolUseIds:
        """An assistant turn begins (returns self)."""
        self.last, self.answered = set(), set()
        return self

    def add(self, tool_id: str, param: str) -> None:
        """A tool_use block's id (the field `param`). Raises APIError when it was given before."""
        if tool_id in self.seen:
            raise APIError(
                f"{param} {json.dumps(tool_id)} is the id of an earlier tool_use block: tool_use ids are unique",
                param=param,
            )
        self.seen.add(tool_id)
        self.last.add(tool_id)

    def answer(self, tool_id: object, param: str) -> str:
        """A tool_result block's tool_use_id (the field `param`), returned. Raises APIError unless
        it answers, for the first time, a tool_use block of the assistant turn just before."""
        if isinstance(tool_id, str) and tool_id in self.last:
            if tool_id in self.answered:
                raise APIError(
                    f"{param} {json.dumps(tool_id)} is answered twice: give one tool_result", param=param
                )
            self.answered.add(tool_id)
            return tool_id
        if isinstance(tool_id, str) and tool_id in self.seen:
            raise APIError(
                f"{param} {json.dumps(tool_id)} answers a tool_use block of an earlier assistant turn: "
                "tool_result blocks answer the tool_use blocks of the assistant turn just before them",
                param=param,
            )
        raise APIError(
            f"{param} {json.dumps(tool_id)} answers no tool_use block of the assistant turn before it",
            param=param,
        )
