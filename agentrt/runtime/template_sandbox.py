"""The sandbox a chat template renders in: transformers' jinja2 ImmutableSandboxedEnvironment (its
options, globals, filters and extensions, copied from the environment the installed transformers
builds, so a render equals `apply_chat_template`'s), with a budget of time and size enforced while
rendering (`RenderState`: a deadline, a cancel Event, a byte limit; one per thread, since a
compiled template may render in several at once).

Time. Template code can only run long by iterating (jinja2 has no while loop) or by calling
(macros, recursion, `loop(...)` of recursive loops): every `{% for %}` iterates through
`BudgetedEnvironment.ticking` (the parsed template's loops are rewritten to
`for x in environment.ticking(iterable)`), and every call, filter and output piece passes a hook,
each checking the deadline and the cancel Event. So a loop that produces nothing stops within its
budget, and a render stops at once when its Event is set (client gone, shutdown). This costs a
generator step per iteration: the whole budgeted render of a 20-turn Qwen3 conversation takes 1.6x
apply_chat_template's time, where a line tracer (`sys.settrace`, local tracing of the template's
frames only) took 10-15x on CPython 3.11: tracing mode slows every function the thread runs
(bench/chat_template_budget.py, docs/benchmarks.md).

jinja2's sandbox stops unsafe attribute access and caps `range` at 100,000 items, but lets a
template build a string of any size in one C call (`"x" * 10**9`, `s ~ s` doubled in a loop,
`"x"|center(10**9)`, `"%0999999999d" % 1`) or compute an integer of any size (`9 ** 10**9`), none
of which a deadline check can interrupt. Here, through jinja2's sandbox hooks:

- every piece of output, at any nesting level (top level, macro, `{% set %}` block), passes
  `BudgetedEnvironment.counted`, which adds its UTF-8 bytes to the render's count and raises
  BudgetExceeded past `RenderState.max_bytes` (a macro's output counts where it is made and again
  where it is placed, so the count bounds the memory output can hold);
- `*`, `+`, `%` and `**` (`intercepted_binops` / `call_binop`) and `~` (the code generator's
  `visit_Concat`) estimate their result's size first and refuse one over `max_bytes` (strings by
  characters, lists by 8 bytes an item, integers over MAX_INT_BITS bits) before it is allocated;
- calls of str / bytes / int methods and of filters refuse an integer argument over `max_bytes`
  (a width, a length) and a result over it; `join`, `replace`, `translate`, `expandtabs`,
  `indent`, `wordwrap`, `format`, `batch` and `lipsum` estimate their product first; `str.format`
  fields refuse a width or precision over it.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import time
from dataclasses import dataclass

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

MAX_INT_BITS = 1 << 16  # an integer result of more bits is refused: C bignum arithmetic cannot be interrupted
_POINTER_BYTES = 8  # a list / tuple / dict item, counted as one pointer
# the Environment options copied from transformers' environment (constructor argument = attribute)
_ENVIRONMENT_OPTIONS = (
    "block_start_string",
    "block_end_string",
    "variable_start_string",
    "variable_end_string",
    "comment_start_string",
    "comment_end_string",
    "line_statement_prefix",
    "line_comment_prefix",
    "trim_blocks",
    "lstrip_blocks",
    "newline_sequence",
    "keep_trailing_newline",
    "undefined",
    "finalize",
    "autoescape",
)
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsab%]")
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d+)?[_,]?(?:\.(\d+))?")


class BudgetExceeded(BaseException):
    """Raised inside template code when the render's budget is spent. A BaseException, so that no
    `except Exception` in jinja2, a filter or transformers' helpers swallows it. `kind`: "time",
    "size" or "cancelled"; `detail`: what was refused (e.g. "'*' would build 1,000,000,000
    characters")."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


@dataclass
class RenderState:
    """One render's budget and what it has spent: `deadline` (time.monotonic() seconds; inf: none),
    `max_bytes` (the most bytes of output and the largest value it may build), `cancel` (an Event
    that stops the render when set; None: never), `produced` (output bytes so far, every level)."""

    max_bytes: int
    deadline: float = float("inf")
    cancel: threading.Event | None = None
    produced: int = 0


class BudgetedCodeGenerator(CodeGenerator):
    """jinja2's code generator with every output piece wrapped in `environment.counted(...)` and
    `~` compiled to `environment.concat_values(...)` (jinja2's own emits `str_join`, which no
    sandbox hook sees)."""

    def _output_child_pre(self, node, frame, finalize) -> None:
        self.write("environment.counted(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node, frame, finalize) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def _output_const_repr(self, group) -> str:
        return f"environment.counted({super()._output_const_repr(group)})"

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BudgetedFormatter(SandboxedFormatter):
    """str.format's formatter: a field's width or precision over the budget is refused."""

    def format_field(self, value, format_spec: str):
        m = _FORMAT_SPEC.match(format_spec)
        if m is not None:
            for number in m.groups():
                if number is not None:
                    self._env.check_size(int(number), "a str.format width or precision")
        return super().format_field(value, format_spec)


class _BudgetedEscapeFormatter(_BudgetedFormatter, SandboxedEscapeFormatter):
    pass


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """An ImmutableSandboxedEnvironment configured as `base` (transformers' environment: options,
    globals, filters, tests, extensions), with the size budget of the module docstring. The budget
    of the render running on the calling thread is `begin(state)` ... `end()`; outside a render
    (e.g. while jinja2 folds constants at compile time) `idle_max_bytes` applies."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = BudgetedCodeGenerator

    def __init__(self, base, idle_max_bytes: int):
        options = {name: getattr(base, name) for name in _ENVIRONMENT_OPTIONS}
        super().__init__(**options, extensions=[type(e) for e in base.extensions.values()])
        self.globals.update(base.globals)
        self.tests.update(base.tests)
        self.filters.update({name: self._budgeted_filter(name, f) for name, f in base.filters.items()})
        self._local = threading.local()
        self._idle = RenderState(max_bytes=idle_max_bytes)

    # ---- the render's state ----------------------------------------------------------------------
    def begin(self, state: RenderState) -> None:
        """Make `state` the budget of renders on the calling thread (until `end`)."""
        self._local.state = state

    def end(self) -> None:
        self._local.state = None

    def state(self) -> RenderState:
        return getattr(self._local, "state", None) or self._idle

    @staticmethod
    def tick(state: RenderState) -> None:
        """Raises BudgetExceeded("time") past the deadline, BudgetExceeded("cancelled") once the
        cancel Event is set."""
        if time.monotonic() > state.deadline:
            raise BudgetExceeded("time", "the deadline passed")
        if state.cancel is not None and state.cancel.is_set():
            raise BudgetExceeded("cancelled", "cancelled")

    def ticking(self, iterable):
        """`iterable`'s items, the deadline and the cancel Event checked before each (every
        `{% for %}` of a template compiled here iterates through it)."""
        state = self.state()
        deadline, cancel, monotonic = state.deadline, state.cancel, time.monotonic
        for item in iterable:
            if monotonic() > deadline or (cancel is not None and cancel.is_set()):
                self.tick(state)
            yield item

    def _parse(self, source, name, filename):
        """jinja2's parse, then every for loop's iterable wrapped in `environment.ticking(...)`."""
        tree = super()._parse(source, name, filename)
        for loop in list(tree.find_all(nodes.For)):
            ticking = nodes.EnvironmentAttribute("ticking", lineno=loop.iter.lineno)
            loop.iter = nodes.Call(ticking, [loop.iter], [], None, None, lineno=loop.iter.lineno)
        return tree

    def check_size(self, size: int, what: str) -> None:
        """Raises BudgetExceeded("size") when `size` (bytes, characters or items x 8) is over the
        render's max_bytes; `what` names what would be built."""
        limit = self.state().max_bytes
        if size > limit:
            raise BudgetExceeded("size", f"{what} would be {size:,} bytes, over the {limit:,}-byte budget")

    def check_value(self, value, what: str):
        """`value`, after check_size of its size (str / bytes by length, containers by items)."""
        self.check_size(_size(value), what)
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise BudgetExceeded("size", f"{what} would be an integer of {value.bit_length():,} bits")
        return value

    # ---- hooks the generated code calls -----------------------------------------------------------
    def counted(self, piece):
        """One output piece (str): its UTF-8 bytes added to the render's count. Raises
        BudgetExceeded("size") past max_bytes."""
        state = self.state()
        self.tick(state)
        n = len(piece)
        if not piece.isascii():
            n = len(str.encode(piece, "utf-8", "surrogatepass"))
        state.produced += n
        if state.produced > state.max_bytes:
            raise BudgetExceeded(
                "size", f"the output would pass {state.max_bytes:,} bytes ({state.produced:,} produced)"
            )
        return piece

    def concat_values(self, values: tuple) -> str:
        """`a ~ b ~ ...`: their strings joined (jinja2's `str_join`; transformers renders without
        autoescape), refused before joining when over the budget."""
        parts = [str(v) for v in values]
        self.check_size(sum(map(len, parts)), "'~'")
        return "".join(parts)

    def call_binop(self, context, operator: str, left, right):
        """`*`, `+`, `%`, `**` with their result's size estimated first (see the module docstring)."""
        if operator == "**":
            if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                bits = (abs(left).bit_length() - 1) * right  # at least
                if bits > MAX_INT_BITS:
                    raise BudgetExceeded("size", f"'**' would build an integer of at least {bits:,} bits")
        elif operator == "*":
            if _is_int(left) and _is_int(right):
                bits = left.bit_length() + right.bit_length()
                if bits > MAX_INT_BITS:
                    raise BudgetExceeded("size", f"'*' would build an integer of about {bits:,} bits")
            elif _is_int(right) or _is_int(left):
                seq, n = (left, right) if _is_int(right) else (right, left)
                self.check_size(_size(seq) * max(n, 0), "'*'")
        elif operator == "+":
            if _sized(left) and _sized(right):
                self.check_size(_size(left) + _size(right), "'+'")
        elif operator == "%" and isinstance(left, str):
            self._check_printf(left, right, "'%'")
        return self.check_value(self.binop_table[operator](left, right), f"'{operator}'")

    def call(self, context, obj, /, *args, **kwargs):
        """A call from template code, after a tick: str / bytes / int methods and `lipsum` checked
        before and after (module docstring); every other callable as the sandbox calls it."""
        self.tick(self.state())
        owner = getattr(obj, "__self__", None)
        if not (isinstance(owner, (str, bytes, int)) or obj is self.globals.get("lipsum")):
            return super().call(context, obj, *args, **kwargs)
        name = getattr(obj, "__name__", "a call")
        if name == "join" and args and not isinstance(args[0], (list, tuple)):
            args = (list(args[0]), *args[1:])  # counted before joining
        self._check_args(args, kwargs, f"{name}()")
        estimate = _method_estimate(obj, owner, args, kwargs, self.globals.get("lipsum"))
        if estimate is not None:
            self.check_size(estimate, f"{name}()")
        return self.check_value(super().call(context, obj, *args, **kwargs), f"{name}()")

    def wrap_str_format(self, value):
        """jinja2's sandboxed str.format / format_map, with `_BudgetedFormatter` (widths checked)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        f_self = value.__self__
        formatter = (
            _BudgetedEscapeFormatter(self, escape=f_self.escape)
            if isinstance(f_self, Markup)
            else _BudgetedFormatter(self)
        )
        str_type, is_map = type(f_self), value.__name__ == "format_map"

        def budgeted(*args, **kwargs):
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument and no keyword arguments")
                args, kwargs = (), args[0]
            return self.check_value(str_type(formatter.vformat(f_self, args, kwargs)), "str.format()")

        return functools.update_wrapper(budgeted, value)

    # ---- filters and calls -------------------------------------------------------------------------
    def _check_args(self, args, kwargs, what: str) -> None:
        for a in (*args, *kwargs.values()):
            if _is_int(a):
                self.check_size(abs(a), f"{what} with argument {a}")

    def _check_printf(self, fmt: str, values, what: str) -> None:
        numbers = values if isinstance(values, tuple) else (values,)
        for width, precision in _PRINTF_SPEC.findall(fmt):
            for n in (width, precision):
                if n == "*":
                    self._check_args(numbers, {}, what)
                elif n:
                    self.check_size(int(n), f"{what} with a width or precision of {n}")
        self.check_size(len(fmt) + sum(_size(v) for v in numbers), what)

    def _budgeted_filter(self, name: str, f):
        """`f` with its integer arguments and its result checked, and the products of the
        amplifying filters estimated before it runs."""
        estimate = _FILTER_ESTIMATES.get(name)
        try:
            signature = inspect.signature(f) if estimate is not None else None
        except (TypeError, ValueError):  # a builtin without a signature: checked after, not before
            signature = None

        @functools.wraps(f)  # keeps jinja_pass_arg: the filter gets its context / environment as before
        def budgeted(*args, **kwargs):
            self.tick(self.state())
            self._check_args(args, kwargs, f"the {name} filter")
            if signature is not None:
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:
                    bound = None  # the filter raises its own error for these arguments
                if bound is not None:
                    bound.apply_defaults()
                    size, args, kwargs = estimate(bound)
                    self.check_size(size, f"the {name} filter")
            return self.check_value(f(*args, **kwargs), f"the {name} filter")

        return budgeted


# ---- sizes and estimates (bytes: str and bytes by length, containers 8 bytes an item) ------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sized(x) -> bool:
    return isinstance(x, (str, bytes, list, tuple))


def _size(x) -> int:
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if isinstance(x, (list, tuple, dict, set, frozenset)):
        return _POINTER_BYTES * len(x)
    return 0


def _text_len(x) -> int:
    return len(x) if isinstance(x, (str, bytes)) else len(str(x))


def _method_estimate(obj, owner, args, kwargs, lipsum) -> int | None:
    """Bytes a str / bytes method (or lipsum) call would build, for those whose result can far
    exceed their arguments; None for the others (checked after the call)."""
    name = getattr(obj, "__name__", "")
    if obj is lipsum and lipsum is not None:
        n = args[0] if args else kwargs.get("n", 5)
        longest = args[3] if len(args) > 3 else kwargs.get("max", 100)
        return 16 * max(n, 0) * max(longest, 0) if _is_int(n) and _is_int(longest) else None
    if not isinstance(owner, (str, bytes)):
        return None
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        return sum(_text_len(x) for x in items) + len(owner) * max(len(items) - 1, 0)
    if name == "replace" and len(args) >= 2:
        return _replaced_len(owner, args[0], args[1], args[2] if len(args) > 2 else -1)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0)
    if name == "translate" and args and isinstance(args[0], dict):
        longest = max((_text_len(v) for v in args[0].values() if v is not None), default=1)
        return len(owner) * max(longest, 1)
    return None


def _replaced_len(s, old, new, count) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return len(s)
    occurrences = len(s) + 1 if not old else s.count(old)
    if _is_int(count) and count >= 0:
        occurrences = min(occurrences, count)
    return len(s) + occurrences * len(new)


def _estimate_indent(b):
    s, width = b.arguments["s"], b.arguments["width"]
    per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    return len(str(s)) + (str(s).count("\n") + 1) * per_line, b.args, b.kwargs


def _estimate_join(b):
    items = list(b.arguments["value"])  # a generator is consumed here: the filter gets the list
    b.arguments["value"] = items
    sep = str(b.arguments.get("d", ""))
    return sum(_text_len(x) for x in items) + len(sep) * max(len(items) - 1, 0), b.args, b.kwargs


def _estimate_replace(b):
    a = b.arguments
    count = a.get("count")
    return (
        _replaced_len(str(a["s"]), str(a["old"]), str(a["new"]), -1 if count is None else count),
        b.args,
        b.kwargs,
    )


def _estimate_wordwrap(b):
    a = b.arguments
    s, width = str(a["s"]), a["width"] if _is_int(a["width"]) else 79
    wrap = a["wrapstring"] if a["wrapstring"] is not None else "\n"
    return len(s) + (len(s) // max(width, 1) + 1) * len(str(wrap)), b.args, b.kwargs


def _estimate_format(b):
    a = b.arguments
    fmt, values = str(a["value"]), a["args"] or a["kwargs"]
    numbers = [v for v in (values.values() if isinstance(values, dict) else values) if _is_int(v)]
    size = len(fmt) + sum(_size(v) for v in (values.values() if isinstance(values, dict) else values))
    for width, precision in _PRINTF_SPEC.findall(fmt):
        for n in (width, precision):
            size = max(size, int(n) if n.isdigit() else max(numbers, default=0) if n == "*" else 0)
    return size, b.args, b.kwargs


def _estimate_batch(b):
    n = b.arguments["linecount"]
    return _POINTER_BYTES * (n if _is_int(n) else 0), b.args, b.kwargs


def _estimate_tojson(b):
    indent = b.arguments.get("indent")
    per_level = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
    if per_level > 16:  # each line indents by depth x this: refused rather than estimated
        return float("inf"), b.args, b.kwargs
    return 0, b.args, b.kwargs


_FILTER_ESTIMATES = {
    "indent": _estimate_indent,
    "join": _estimate_join,
    "replace": _estimate_replace,
    "wordwrap": _estimate_wordwrap,
    "format": _estimate_format,
    "batch": _estimate_batch,
    "tojson": _estimate_tojson,
}
