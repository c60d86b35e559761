"""Tools in the prompt: which call format the model writes (read from its chat template:
detection.py), and the messages and tool definitions handed to the chat template.

With a *native* template (one that renders tools itself) tool calls and results pass through in
Hugging Face's shape, adjusted to what the family's template expects (DeepSeek V3.1's arguments as
JSON text, V3.2's as an object whose values its template types, Mistral's 9-character call ids, Kimi's `functions.NAME:N` ids, Qwen3-Coder's non-string values
as JSON, one call per turn for Llama 3.x, tool results moved onto the calling turn as
`tool_responses` for Gemma 4's first template); where the template renders no tool list (DeepSeek V3.1)
the family's own tools prompt goes into the system message, and where it renders no earlier calls
(Kimi K2's first template) they are written as text in the family's syntax. Otherwise the
*generic* format (hermes) is used: tool definitions go into the system prompt (``TOOLS_PROMPT``),
earlier calls and tool results are written back as text in the same syntax.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

from agentrt.api.tools.detection import Detected, detect
from agentrt.api.tools.validation import ToolPlan
from agentrt.grammars.tool_calls import FORMATS, ToolCallFormat

logger = logging.getLogger(__name__)

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

GENERIC_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON Schema
signatures, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write:
{example}"""

DEEPSEEK_TOOLS_PROMPT = """## Tools
You have access to the following tools:
{tools}
IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>

Where:

- `tool_call_name` must be an exact match to one of the available tools
- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema
- For multiple tool calls, chain them directly without separators or spaces"""


def detect_format(chat_template: str | None) -> tuple[str, bool]:
    """(format name, native): the model's call format read from its chat template; native is
    whether the template itself renders tool turns (else the generic hermes prompt is used).
    detection.detect has the whole set-up."""
    d = detect(chat_template)
    return d.name, d.native


@dataclass(frozen=True)
class ToolPrompt:
    """How a server writes tools into prompts: `fmt` the call format the model writes; `native` the
    chat template renders tools itself (else the generic prompt); `exclude_when_none` leaves the
    tools out of the prompt when tool_choice is "none"; `detected` the template's set-up
    (detection.Detected: whether it renders the tool list and earlier calls)."""

    fmt: ToolCallFormat
    native: bool
    exclude_when_none: bool = False
    detected: Detected | None = None

    @classmethod
    def for_template(
        cls, chat_template: str | list | None, tool_call_format: str = "auto", exclude_when_none: bool = False
    ) -> ToolPrompt:
        """The set-up for a model's chat template (a tokenizer's `chat_template`: text, or a list of
        named templates). tool_call_format: "auto" (read from the template) or a name in
        grammars/tool_calls.FORMATS. A template written for a call syntax no parser reads gets the
        generic prompt, with a warning naming both. Raises ValueError on an unknown format."""
        if tool_call_format not in ("auto", *FORMATS):
            raise ValueError(f"unknown tool call format '{tool_call_format}' (auto, {', '.join(FORMATS)})")
        d = detect(_template_text(chat_template))
        if d.unsupported and tool_call_format == "auto":
            logger.warning(
                "tool calls: the chat template writes calls in the %s format, which agentrt does not "
                "parse; tool calls use the generic prompt instead (hermes: the tools and a "
                "<tool_call>{json}</tool_call> instruction in the system prompt), which this model "
                "was not trained on. Pick one with --tool-call-format.",
                d.unsupported,
            )
        fmt = FORMATS[d.name if tool_call_format == "auto" else tool_call_format]
        # a template that renders tools in another syntax than the one asked for: use the generic prompt
        return cls(fmt, d.native and fmt.name == d.name, exclude_when_none, d)

    def render(self, messages: list[dict], plan: ToolPlan | None) -> tuple[list[dict], list[dict] | None]:
        """`render_messages` with this set-up."""
        return render_messages(messages, plan, self.native, self.exclude_when_none, self.fmt, self.detected)


def _template_text(chat_template: str | list | None) -> str:
    """The template that renders requests with tools: the text itself, or of a list of named
    templates (Hugging Face's `[{"name", "template"}]`) the "tool_use" one (transformers picks it
    when tools are given), else "default", else all of them."""
    if isinstance(chat_template, str) or chat_template is None:
        return chat_template or ""
    named = {t.get("name"): t.get("template") or "" for t in chat_template if isinstance(t, dict)}
    return named.get("tool_use") or named.get("default") or "\n".join(named.values())


def render_messages(
    messages: list[dict],
    plan: ToolPlan | None,
    native: bool,
    exclude_tools: bool = False,
    fmt: ToolCallFormat | None = None,
    detected: Detected | None = None,
) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for the template or None). `messages` are OpenAI
    dicts (role, content text, tool_calls, tool_call_id, name). With a native template, tool calls
    and tool results pass through in Hugging Face's shape (arguments as objects, adjusted to `fmt`:
    module docstring); otherwise the generic format writes them as text and the tool definitions
    go into the system prompt."""
    fmt = fmt or FORMATS["hermes"]
    d = detected or Detected(fmt.name, native)
    out = _native_messages(messages, fmt, d) if native else [_generic_message(m, fmt) for m in messages]
    if plan is None or (plan.mode == "none" and exclude_tools):
        return out, None
    tool_defs = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]},
        }
        for t in plan.all_tools
    ]
    if native and d.tools_in_template:
        return out, tool_defs
    if native and fmt.name == "deepseek_v3_1":
        prompt = DEEPSEEK_TOOLS_PROMPT.format(tools="".join(_deepseek_tool(t["function"]) for t in tool_defs))
    elif fmt.name == "hermes":
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_defs))
    else:
        example = fmt.render_calls([("<function name>", {"<argument>": "<value>"})])
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_defs)
        prompt = GENERIC_PROMPT.format(tools=tools, example=example)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _deepseek_tool(f: dict) -> str:
    params = json.dumps(f["parameters"], ensure_ascii=False)
    return f"\n### {f['name']}\nDescription: {f['description']}\n\nParameters: {params}\n"


def _native_messages(messages: list[dict], fmt: ToolCallFormat, d: Detected) -> list[dict]:
    """OpenAI messages in Hugging Face's chat-template shape, as `fmt`'s template expects them."""
    ids: dict[str, str] = {}  # the call ids the template sees (mistral, kimi_k2), by request id
    out: list[dict] = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning_content") is not None:  # an earlier turn's: the template keeps or drops it
            msg["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls") or []
        if calls and not d.calls_in_template:  # written as text in the format's syntax
            text = fmt.render_calls(
                [(c["function"]["name"], _object(c["function"]["arguments"])) for c in calls], len(ids)
            )
            for c in calls:
                ids[c.get("id") or str(len(ids))] = _template_id(fmt, c, len(ids))
            msg["content"] = msg["content"] + text
        elif calls:
            shaped = []
            for c in calls:
                template_id = _template_id(fmt, c, len(ids))
                ids[c.get("id") or str(len(ids))] = template_id
                shaped.append(
                    {
                        "type": "function",
                        "id": template_id,
                        "function": {"name": c["function"]["name"], "arguments": _arguments(fmt, c)},
                    }
                )
            if d.single_call_turns and len(shaped) > 1:  # Llama 3.x: one call per assistant turn
                out.extend({**msg, "content": "", "tool_calls": [s]} for s in shaped[:-1])
                shaped = shaped[-1:]
            msg["tool_calls"] = shaped
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            msg["tool_call_id"] = ids.get(tid, tid)
        out.append(msg)
    return _results_on_calls(out) if d.tool_responses else out


def _results_on_calls(messages: list[dict]) -> list[dict]:
    """Gemma 4's first template (Detected.tool_responses) renders no tool message: it takes the
    results as `tool_responses` ({name, response}) on the assistant message that made the calls,
    after which the model's turn goes on (no `<turn|>`, no new `<|turn>model`). So each tool
    message moves onto the calling message (its name: the call's, found by id; its response: the
    object when the content is a JSON object's text, else the text), and an answer-only assistant
    message right after the results joins that message's content (Google's documented shape: calls,
    results, then the answer, one model turn). A calling message that had content of its own keeps
    it (the template writes it after the results) and the next message opens a new turn."""
    out: list[dict] = []
    for m in messages:
        last = out[-1] if out else None
        if m["role"] == "tool" and last is not None and last.get("tool_calls"):
            names = {c.get("id"): c["function"]["name"] for c in last["tool_calls"]}
            result = {
                "name": names.get(m.get("tool_call_id"), "unknown"),
                "response": _response(m["content"]),
            }
            last.setdefault("tool_responses", []).append(result)
            continue
        if (
            m["role"] == "assistant"
            and last is not None
            and last.get("tool_responses")
            and not last["content"]
            and not m.get("tool_calls")
        ):
            last["content"] = m["content"]
            continue
        out.append(m)
    return out


def _response(content: str):
    """A tool result for `tool_responses`: the object a JSON object's text holds, else the text."""
    try:
        value = json.loads(content)
    except (ValueError, RecursionError):
        return content
    return value if isinstance(value, dict) else content


def _template_id(fmt: ToolCallFormat, call: dict, n: int) -> str | None:
    """The call id as the family's template expects it: Mistral's 9 letters and digits, Kimi's
    `functions.NAME:N` (N counts the calls of the conversation); others keep the request's."""
    cid = call.get("id")
    if fmt.name in ("mistral", "mistral_v11"):
        if isinstance(cid, str) and len(cid) == 9 and cid.isalnum():
            return cid
        return hashlib.sha256(str(cid or n).encode()).hexdigest()[:9]
    if fmt.name == "kimi_k2":
        return f"functions.{call['function']['name']}:{n}"
    return cid


def _arguments(fmt: ToolCallFormat, call: dict):
    """A call's arguments for the template: an object (JSON text for DeepSeek V3.1, whose template
    concatenates strings; an object for V3.2, whose template writes strings raw and the rest as JSON; non-string values as JSON text for the XML formats, whose templates write
    values with `| string`)."""
    args = _object(call["function"]["arguments"])
    if fmt.name == "deepseek_v3_1":
        return json.dumps(args, ensure_ascii=False) if not isinstance(args, str) else args
    if fmt.style == "xml" and isinstance(args, dict):
        return {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in args.items()}
    if fmt.style == "pythonic" and isinstance(args, dict) and len(args) > 1:
        # the template writes `{{ key }}={{ val | tojson }}` per item, and vLLM's Gemma 3 template
        # loses the ", " between items (a `set` inside its loop does not outlive the iteration): all
        # but the last keyword go into one key, so the call reads `f(a=1, b="x")` either way
        *head, (last_key, last_value) = args.items()
        joined = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in head)
        return {f"{joined}, {last_key}": last_value}
    return args


def _generic_message(m: dict, fmt: ToolCallFormat) -> dict:
    """An OpenAI message for a template without tool support: calls in the format's syntax in the
    assistant's text (hermes <tool_call> blocks), tool results as <tool_response> user turns."""
    role, content = m["role"], m.get("content") or ""
    if role == "assistant" and m.get("tool_calls"):
        calls = [(c["function"]["name"], _object(c["function"]["arguments"])) for c in m["tool_calls"]]
        if fmt.name == "hermes":
            blocks = [_call_block(n, a) for n, a in calls]
        else:
            blocks = [fmt.render_calls(calls)]
        out = {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}
    else:
        out = {"role": role, "content": content}
    if role == "assistant" and m.get("reasoning_content") is not None:
        out["reasoning_content"] = m["reasoning_content"]  # the template keeps or drops it
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return out


def _call_block(name: str, arguments) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _object(arguments):
    """Call arguments as a JSON value (a string that is not JSON stays a string)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
