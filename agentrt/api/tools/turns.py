"""The tool turns of a conversation, checked by each API's rules: OpenAI's for chat completions
(assistant `tool_calls`, `tool` messages: `check_tool_messages`) and the Responses API
(function_call and function_call_output items), both kept by `CallIds`; Anthropic's for the
Messages API (tool_use and tool_result blocks: `ToolUseIds`).

Every check raises APIError (400) naming the request field at fault; ids are quoted by
errors.shown (cut when long).
"""

from __future__ import annotations

import json

from agentrt.api.errors import APIError, shown


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


class CallIds:
    """OpenAI's rules for the calls of a conversation: a call's id is given once, its arguments are
    the JSON text of an object ("" for none), and an answer names a call given before it that has
    no answer yet (each call is answered at most once). `call` each call and `answer` each answer,
    in conversation order; `noun` names a call in messages ("tool call", "function_call item")."""

    def __init__(self, noun: str):
        self.noun = noun
        self.calls: set[str] = set()  # every call id so far
        self.order: list[str] = []  # the same, in conversation order
        self.answered: set[str] = set()

    def call(self, call_id: str | None, arguments: object, id_param: str, arguments_param: str) -> None:
        """A call (`id_param`, `arguments_param`: the fields of its id and arguments). A call
        without an id (chat allows one) is checked for its arguments only."""
        ok = isinstance(arguments, str)
        if ok and arguments:
            try:  # NaN / Infinity are Python's extension, not JSON (RFC 8259)
                ok = isinstance(json.loads(arguments, parse_constant=_not_json), dict)
            except (ValueError, RecursionError):
                ok = False
        if not ok:
            raise APIError(
                f"{arguments_param} must be the JSON text of the call's arguments object, got "
                f"{shown(arguments)}",
                param=arguments_param,
            )
        if call_id is None:
            return
        if call_id in self.calls:
            raise APIError(
                f"{id_param} {shown(call_id)} is the id of an earlier {self.noun}: call ids are unique",
                param=id_param,
            )
        self.calls.add(call_id)
        self.order.append(call_id)

    def check_answered(self, param: str) -> None:
        """Every call so far has its answer: called at each turn that must come after the answers
        (`param`: that turn's field; a conversation may end with calls, answered by the client
        later). Raises APIError naming the first call left unanswered (OpenAI: calls are followed by
        an answer to each)."""
        pending = [c for c in self.order if c not in self.answered]
        if pending:
            raise APIError(
                f"{param}: the {self.noun} {shown(pending[0])} has no answer before it "
                f"({len(pending)} unanswered): answer each call before the conversation goes on",
                param=param,
            )

    def answer(self, call_id: str, param: str) -> None:
        """An answer to call `call_id` (`param`: the field of the id)."""
        if call_id not in self.calls:
            raise APIError(f"{param} {shown(call_id)} answers no {self.noun} before it", param=param)
        if call_id in self.answered:
            raise APIError(
                f"{param} {shown(call_id)} answers a {self.noun} answered before: give each call one answer",
                param=param,
            )
        self.answered.add(call_id)


def check_tool_messages(messages: list[dict]) -> None:
    """OpenAI's rules for the tool turns of chat `messages` (dicts as ChatMessage.as_dict gives
    them): `tool_calls` only on assistant messages, each call's id unique and its arguments the
    JSON text of an object, every `tool` message answering (`tool_call_id`) a call of an earlier
    assistant message that no other tool message answered. Raises APIError naming the field."""
    ids = CallIds("tool call")
    for i, m in enumerate(messages):
        if m["role"] != "tool":
            ids.check_answered(f"messages[{i}]")
        if m.get("tool_calls") and m["role"] != "assistant":
            raise APIError(
                f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls"
            )
        for j, c in enumerate(m.get("tool_calls") or []):
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(c["function"].get("name"), str) or not c["function"]["name"]:
                raise APIError(
                    f"{where}.function.name must name the tool called", param=f"{where}.function.name"
                )
            ids.call(
                c.get("id") or None, c["function"]["arguments"], f"{where}.id", f"{where}.function.arguments"
            )
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not tid:
                raise APIError(
                    f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id"
                )
            ids.answer(tid, f"messages[{i}].tool_call_id")


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
                f"{param} {shown(tool_id)} is the id of an earlier tool_use block: tool_use ids are unique",
                param=param,
            )
        self.seen.add(tool_id)
        self.last.add(tool_id)

    def check_answered(self, param: str) -> None:
        """The user turn after an assistant turn (`param`: where that user turn begins) is over:
        raises APIError unless every tool_use block of the assistant turn has its tool_result in it
        (Anthropic refuses a tool_use without one)."""
        missing = sorted(self.last - self.answered)
        if missing:
            ids = ", ".join(shown(t) for t in missing[:3]) + (
                f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            )
            raise APIError(
                f"{param}: tool_use ids were found without tool_result blocks right after them: {ids}; "
                "each tool_use block of an assistant turn is answered by a tool_result block in the user "
                "turn right after it",
                param=param,
            )

    def answer(self, tool_id: object, param: str) -> str:
        """A tool_result block's tool_use_id (the field `param`), returned. Raises APIError unless
        it answers, for the first time, a tool_use block of the assistant turn just before."""
        if isinstance(tool_id, str) and tool_id in self.last:
            if tool_id in self.answered:
                raise APIError(
                    f"{param} {shown(tool_id)} is answered twice: give one tool_result", param=param
                )
            self.answered.add(tool_id)
            return tool_id
        if isinstance(tool_id, str) and tool_id in self.seen:
            raise APIError(
                f"{param} {shown(tool_id)} answers a tool_use block of an earlier assistant turn: "
                "tool_result blocks answer the tool_use blocks of the assistant turn just before them",
                param=param,
            )
        raise APIError(
            f"{param} {shown(tool_id)} answers no tool_use block of the assistant turn before it",
            param=param,
        )
