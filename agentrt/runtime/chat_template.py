"""Chat templates rendered under a budget of time and size, enforced while rendering.

A chat template is code: a template given with --chat-template, reached by one user message, may
loop for hours (two nested `range(100000)` loops), build a string of any size, or render for
seconds on a huge conversation; `apply_chat_template` renders to the end whatever it costs, in a
worker thread that neither the client leaving nor SIGTERM stops. `ChatRenderer.render` renders the
same template, over the same inputs, in the same sandbox as transformers (its environment's
options, globals, filters and extensions; its preparation of messages, tools and kwargs), so the
text is identical, with:

- time: every loop iteration, call, filter and output piece of the template checks a deadline and
  a cancel Event (template_sandbox.py), so a loop that produces nothing stops within its budget
  and a render stops at once when its client leaves or the server shuts down;
- size: the same sandbox counts every output piece as it is made and refuses any value over the
  byte budget before building it;
- the context: `check_prefix` sees the text rendered so far whenever it doubles, so a conversation
  that cannot fit the context stops rendering as soon as that is certain.

A spent budget is a TemplateBudgetError (a 400 naming the budget and its flag); a cancelled render a
ServiceUnavailableError. Measured: docs/benchmarks.md ("Chat template budget").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from agentrt.errors import (
    AgentrtError,
    ChatTemplateError,
    InternalError,
    ServiceUnavailableError,
    TemplateBudgetError,
)

TIME_FLAG, SIZE_FLAG = "--chat-template-budget", "--chat-template-max-bytes"


@dataclass(frozen=True)
class TemplateBudget:
    """What one chat template render may spend. `time_s`: wall-clock seconds from the start of the
    render (its inputs' preparation included); `max_bytes`: UTF-8 bytes of output the template may
    produce at all its levels (a macro's output counts where it is made and where it is placed),
    and the largest string (characters), bytes or list (8 bytes an item) it may build. A real
    template renders a conversation in milliseconds and kilobytes. Raises ValueError naming the
    field when not positive."""

    time_s: float = 1.0
    max_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and math.isfinite(self.time_s)):
            raise ValueError(
                f"chat template budget time_s must be a positive number of seconds, got {self.time_s}"
            )
        if self.max_bytes < 1:
            raise ValueError(f"chat template budget max_bytes must be >= 1, got {self.max_bytes}")


class ChatRenderer:
    """Renders `tokenizer`'s chat template (its `chat_template`, read at each render, so a template
    set later is the one rendered) under `budget`. Compiled templates are kept per template text.
    Thread-safe: renders may run in several threads at once."""

    def __init__(self, tokenizer, budget: TemplateBudget | None = None):
        self.tokenizer = tokenizer
        self.budget = budget or TemplateBudget()
        self._compiled: dict[str, object] = {}
        self._lock = threading.Lock()

    def compile(self, source: str):
        """The jinja2 Template of `source` in the budgeted sandbox (cached). Raises jinja2's
        TemplateSyntaxError when it does not compile, BudgetExceeded-free: jinja2 folds constant
        expressions at compile time, and one over the budget is a TemplateBudgetError."""
        with self._lock:
            template = self._compiled.get(source)
        if template is not None:
            return template
        from agentrt.runtime.template_sandbox import BudgetedEnvironment, BudgetExceeded

        env = BudgetedEnvironment(_transformers_environment(), self.budget.max_bytes)
        try:
            template = env.from_string(source)
        except BudgetExceeded as e:
            raise self._budget_error(e) from None
        with self._lock:
            if len(self._compiled) >= 8:  # a tokenizer has one template, or a few named ones
                self._compiled.clear()
            self._compiled[source] = template
        return template

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        *,
        cancel: threading.Event | None = None,
        check_prefix: Callable[[str], None] | None = None,
        check_from: int = 0,
    ) -> str:
        """`messages` (and `tools`, `template_kwargs`: e.g. enable_thinking) through the chat
        template, as `tokenizer.apply_chat_template(..., tokenize=False)` renders them, within the
        budget. `cancel`: set from any thread to stop the render (client gone, shutdown).
        `check_prefix(text)`: called with the text rendered so far once it reaches `check_from`
        characters and again each time it doubles; what it raises stops the render and is raised.

        Raises ChatTemplateError (param "messages": no chat template, or the template refused
        these inputs: its raise_exception or an error on them), TemplateBudgetError (the time or
        size budget spent), ServiceUnavailableError (cancelled), InternalError (the template does
        not compile), and what check_prefix raises (e.g. ContextLengthError)."""
        state = self._state(cancel)
        try:
            source = self.tokenizer.get_chat_template(None, tools)
        except ValueError as e:
            raise ChatTemplateError(str(e)) from None
        from jinja2 import TemplateError

        try:
            template = self.compile(source)
        except TemplateError as e:  # TemplateSyntaxError: the server's template, not the request
            raise InternalError(f"the chat template does not compile: {e}") from None
        try:
            variables = _template_inputs(
                self.tokenizer, messages, tools, add_generation_prompt, template_kwargs
            )
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(str(e)) from None
        return self._generate(template, variables, state, check_prefix, check_from)

    # ---- internals ---------------------------------------------------------------------------------
    def _state(self, cancel):
        from agentrt.runtime.template_sandbox import RenderState

        return RenderState(self.budget.max_bytes, time.monotonic() + self.budget.time_s, cancel)

    def _generate(self, template, variables: dict, state, check_prefix, check_from: int) -> str:
        from agentrt.runtime.template_sandbox import BudgetExceeded

        env = template.environment
        parts: list[str] = []
        num_chars, next_check = 0, max(check_from, 1)
        env.begin(state)
        try:
            env.tick(state)  # the time preparing the inputs counts
            for piece in template.generate(**variables):
                parts.append(piece)
                num_chars += len(piece)
                if check_prefix is not None and num_chars >= next_check:
                    check_prefix("".join(parts))
                    next_check = 2 * num_chars
        except BudgetExceeded as e:
            raise self._budget_error(e) from None
        except AgentrtError:
            raise
        except RecursionError:
            raise ChatTemplateError("the template recursed too deeply") from None
        except Exception as e:  # noqa: BLE001 - the template's own errors are the request's messages
            raise ChatTemplateError(str(e) or type(e).__name__) from None
        finally:
            env.end()
        return "".join(parts)

    def _budget_error(self, e) -> AgentrtError:
        if e.kind == "cancelled":
            return ServiceUnavailableError(
                "rendering the chat template was stopped: the client left or the server is shutting down"
            )
        b = self.budget
        if e.kind == "time":
            message = (
                f"the chat template ran past its time budget of {b.time_s:g} s ({TIME_FLAG}) rendering "
                "messages and was stopped"
            )
        else:
            message = (
                f"the chat template went over its size budget of {b.max_bytes:,} bytes ({SIZE_FLAG}) "
                f"rendering messages: {e.detail}"
            )
        return TemplateBudgetError(message, limit=e.kind, time_s=b.time_s, max_bytes=b.max_bytes)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's own chat template (transformers'
    apply_chat_template, no budget: in-process callers, the SDK and extraction workers) with the
    generation prompt, encoded without added special tokens (the template writes them)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _transformers_environment():
    """The jinja2 environment the installed transformers renders chat templates in (its sandbox
    class, options, globals such as raise_exception / strftime_now, filters such as tojson,
    extensions such as {% generation %})."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def _template_inputs(tokenizer, messages, tools, add_generation_prompt: bool, template_kwargs) -> dict:
    """What the template sees, prepared as transformers' apply_chat_template / render_jinja_template
    prepare it: message objects as dicts, None-valued keys dropped, everything rebuilt from plain
    JSON types, reasoning aliased under `reasoning_content` and `thinking`; the tokenizer's special
    tokens under the request's kwargs. Raises TypeError for a message that is not a dict."""
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _normalize_chat_messages,
        _plain_template_data,
    )

    chat = _plain_template_data(_normalize_chat_messages(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    kwargs = _plain_template_data({**tokenizer.special_tokens_map, **(template_kwargs or {})})
    return {
        **kwargs,
        "messages": _alias_reasoning_fields(chat),
        "tools": _plain_template_data(tools),
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
