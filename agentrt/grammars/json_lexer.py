"""An incremental lexer over the bytes of a JSON text prefix (RFC 8259), token by token.

Used by runaway-value repair (runtime/repetition.py: which value is being written, its JSON
pointer) and by the unique-strings check (grammars/unique_items.py: which array an element string
completes in, and its value). It works on bytes: the structural characters (`"` `\\` `{` `[` `:`
`,`) never occur inside a multi-byte UTF-8 sequence, so partial-UTF-8 tokens are safe. It assumes
the text is valid (a grammar's output) and does not check it.
"""

from __future__ import annotations

import json


class _Frame:
    """An open object or array: where it opened (output token index), its key / element index, and
    for arrays whether a complete string, object or array element was the last thing in it.
    `node` and `seen`: a subclass's per-container state (grammars/unique_items.py)."""

    __slots__ = ("after_element", "expecting_key", "is_object", "node", "opened", "seen", "where")

    def __init__(self, is_object: bool, opened: int):
        self.is_object, self.opened = is_object, opened
        self.where: str | int | None = None if is_object else 0
        self.expecting_key = is_object
        self.after_element = False
        self.node = self.seen = None

    def copy(self) -> _Frame:
        f = _Frame(self.is_object, self.opened)
        f.where, f.expecting_key, f.after_element = self.where, self.expecting_key, self.after_element
        f.node, f.seen = self.node, self.seen  # immutable (an int, a frozenset): shared
        return f


class JsonPointerTracker:
    """Incremental lexer over the bytes of a JSON text prefix (assumed valid: a grammar's output).

    `in_value_string`: the output is inside a string that is a value (an object member's value, an
    array element, or the top-level value), not a key; `string_opened`: the index of the token that
    opened it. `stack`: the open objects and arrays. `pointer(depth)`: the JSON pointer (RFC 6901) of
    the value being written at that depth (default: the innermost).

    Subclass hooks (no-ops here): `_opened(frame, parent)` after an object or array opens,
    `_keeps(frame)` whether the element strings of array `frame` are buffered, and
    `_element(frame, raw)` when such a string element completes (`raw`: its bytes between the
    quotes, escapes as written)."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.in_string = False
        self.string_is_key = False
        self.string_opened = -1
        self.escape = False
        self.buffering = False  # the open string's bytes are kept (a key, or a kept element)
        # the open string's bytes: the first _buf_len of _buf. Copies share _buf (copying it per
        # token would make a long string's snapshots quadratic in memory); a feed first cuts what
        # another copy appended past its own length, and each string gets a new buffer
        self._buf = bytearray()
        self._buf_len = 0
        self.boundary: tuple[int, int] | None = None

    @property
    def in_value_string(self) -> bool:
        return self.in_string and not self.string_is_key

    @property
    def string_len(self) -> int:
        """Bytes of the open string so far (while `buffering`), escapes as written."""
        return self._buf_len

    @property
    def key_bytes(self) -> bytes:
        """The bytes of the open string so far (while `buffering`), escapes as written."""
        return bytes(self._buf[: self._buf_len])

    def copy(self) -> JsonPointerTracker:
        """An independent tracker in the same state: O(depth), the string buffer shared."""
        t = object.__new__(type(self))
        t.__dict__.update(self.__dict__)
        t.stack = [f.copy() for f in self.stack]
        return t

    def _opened(self, frame: _Frame, parent: _Frame | None) -> None:
        pass

    def _keeps(self, frame: _Frame) -> bool:
        return False

    def _element(self, frame: _Frame, raw: bytes) -> None:
        pass

    def feed(self, data: bytes, token_index: int = -1) -> None:
        """Advance over the bytes of one token (`token_index`: its index in the output). Sets
        `boundary`: (depth of the array, bytes of `data` up to and including the end of the last
        string / object / array element completed in it), or None."""
        self.boundary = None
        if len(self._buf) > self._buf_len:  # another copy went on from this state
            del self._buf[self._buf_len :]
        for i, b in enumerate(data):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:  # closing quote
                    self.in_string = False
                    if self.string_is_key:
                        self._set_key()
                    elif self.stack and not self.stack[-1].is_object:
                        top = self.stack[-1]
                        top.after_element = True
                        self.boundary = (len(self.stack) - 1, i + 1)
                        if self.buffering:
                            self._element(top, self.key_bytes)
                    continue
                if self.buffering:
                    self._buf.append(b)
                    self._buf_len += 1
                continue
            top = self.stack[-1] if self.stack else None
            if b == 0x22:
                self.in_string, self.string_opened = True, token_index
                self.string_is_key = top is not None and top.is_object and top.expecting_key
                self.buffering = self.string_is_key or (
                    top is not None and not top.is_object and self._keeps(top)
                )
                self._buf, self._buf_len = bytearray(), 0
            elif b in (0x7B, 0x5B):  # { [
                frame = _Frame(b == 0x7B, token_index)
                self.stack.append(frame)
                self._opened(frame, top)
            elif b in (0x7D, 0x5D):  # } ]
                if self.stack:
                    self.stack.pop()
                if self.stack and not self.stack[-1].is_object:
                    self.stack[-1].after_element = True
                    self.boundary = (len(self.stack) - 1, i + 1)
            elif b == 0x3A and top is not None and top.is_object:  # : after a key
                top.expecting_key = False
            elif b == 0x2C and top is not None:  # ,
                if top.is_object:
                    top.expecting_key = True
                else:
                    top.where += 1
                    top.after_element = False

    def _set_key(self) -> None:
        raw = self.key_bytes
        try:
            key = json.loads(b'"' + raw + b'"')
        except ValueError:
            key = raw.decode("utf-8", "replace")
        if self.stack:
            self.stack[-1].where = key

    def pointer(self, depth: int | None = None) -> str:
        """The JSON pointer of the value being written inside the first `depth` open containers
        (default: all of them; "" is the top-level value)."""
        parts = []
        for f in self.stack[:depth]:
            s = (f.where or "") if f.is_object else str(f.where)
            parts.append(s.replace("~", "~0").replace("/", "~1"))
        return "".join("/" + p for p in parts)
