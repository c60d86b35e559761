"""Tools in the prompt: which call format the model writes (read from its chat template), and the
messages and tool definitions handed to the chat template.

With a *native* template (one that renders tools itself) tool calls and results pass through in
Hugging Face's shape. Otherwise the *generic* format (hermes) is used: tool definitions go into the
system prompt (``TOOLS_PROMPT``), earlier calls and tool results are written back as text in the
same syntax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentrt.api.tools.validation import ToolPlan
from agentrt.grammars.tool_calls import FORMATS, ToolCallFormat

TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON Schema
signatures, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def detect_format(chat_template: str | None) -> tuple[str, bool]:
    """(format name, native): the model's call format read from its chat template; native is
    whether the template itself renders tools (else the generic hermes prompt is used)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral", "tools" in t
    if "<tool_call>" in t:
        return "hermes", "tools" in t
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json", "tools" in t
    return "hermes", False


@dataclass(frozen=True)
class ToolPrompt:
    """How a server writes tools into prompts: `fmt` the call format the model writes; `native` the
    chat template renders tools itself (else the generic prompt); `exclude_when_none` leaves the
    tools out of the prompt when tool_choice is "none"."""

    fmt: ToolCallFormat
    native: bool
    exclude_when_none: bool = False

    @classmethod
    def for_template(
        cls, chat_template: str | list | None, tool_call_format: str = "auto", exclude_when_none: bool = False
    ) -> ToolPrompt:
        """The set-up for a model's chat template (a tokenizer's `chat_template`: text, or a list of
        named templates). tool_call_format: "auto" (read from the template) or a name in
        grammars/tool_calls.FORMATS. Raises ValueError on an unknown format."""
        if tool_call_format not in ("auto", *FORMATS):
            raise ValueError(f"unknown tool call format '{tool_call_format}' (auto, {', '.join(FORMATS)})")
        text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template)
        detected, native = detect_format(text)
        fmt = FORMATS[detected if tool_call_format == "auto" else tool_call_format]
        # a template that renders tools in another syntax than the one asked for: use the generic prompt
        return cls(fmt, native and fmt.name == detected, exclude_when_none)

    def render(self, messages: list[dict], plan: ToolPlan | None) -> tuple[list[dict], list[dict] | None]:
        """`render_messages` with this set-up."""
        return render_messages(messages, plan, self.native, self.exclude_when_none)


def render_messages(
    messages: list[dict], plan: ToolPlan | None, native: bool, exclude_tools: bool = False
) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for the template or None). `messages` are OpenAI
    dicts (role, content text, tool_calls, tool_call_id, name). With a native template, tool calls
    and tool results pass through in Hugging Face's shape (arguments as objects); otherwise the
    generic format writes them as text and the tool definitions go into the system prompt."""
    out = [(_native_message if native else _generic_message)(m) for m in messages]
    if plan is None or (plan.mode == "none" and exclude_tools):
        return out, None
    tool_defs = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]},
        }
        for t in plan.all_tools
    ]
    if native:
        return out, tool_defs
    prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_defs))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_message(m: dict) -> dict:
    """An OpenAI message in Hugging Face's chat-template shape (call arguments as objects)."""
    msg = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        msg["tool_calls"] = [
            {
                "type": "function",
                "id": c.get("id"),
                "function": {
                    "name": c["function"]["name"],
                    "arguments": _as_object(c["function"]["arguments"]),
                },
            }
            for c in m["tool_calls"]
        ]
    if m["role"] == "tool":
        msg["tool_call_id"] = m.get("tool_call_id")
    return msg


def _generic_message(m: dict) -> dict:
    """An OpenAI message for a template without tool support: calls as <tool_call> blocks in the
    assistant's text, tool results as <tool_response> user turns."""
    role, content = m["role"], m.get("content") or ""
    if role == "assistant" and m.get("tool_calls"):
        blocks = [_call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


def _call_block(name: str, arguments) -> str:
    call = json.dumps({"name": name, "arguments": _as_object(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _as_object(arguments):
    """Call arguments as a JSON value (a string that is not JSON stays a string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
