"""Command-line overrides in Hydra's override grammar.

Forms: ``a.b=v`` (set), ``+a.b=v`` (add), ``++a.b=v`` (add or set), ``~a.b`` and ``~a.b=v`` (delete, the
latter only if the current value equals ``v``). Values follow Hydra's typing: unquoted ``1`` is an int,
``1e-5``/``.5``/``inf``/``nan`` floats, ``true``/``FALSE`` booleans and ``null`` None (case-insensitive);
``[a, b]`` is a list, ``{a: 1}`` a dict, ``'x'``/``"x"`` a string; ``a=`` sets the empty string; ``\\,``,
``\\ `` etc. escape special characters; anything else is a string. Sweeps (``a=1,2``, ``choice(...)``) and
config groups (``group/x=...``, ``key@pkg``) are Hydra features rlfleet does not have and are rejected.

Because rlfleet validates against a schema, ``set``, ``add`` and ``force`` all may create a key the recipe
omitted (missing parent mappings are created); as in Hydra, a dict value merges into an existing dict.
``~a.b`` removes the key so the schema default applies.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlfleet.config.errors import ConfigError, deep_merge, got, short_repr

__all__ = ["Override", "OverrideOp", "apply_overrides", "parse_override", "quote_override_value"]

OverrideOp = Literal["set", "add", "force", "delete"]

_GRAMMAR = (
    "expected key=value, +key=value, ++key=value, ~key or ~key=value with a dotted key "
    "(e.g. policy.optimizer.kwargs.lr=1e-5, ~checkpointing.metric_name)"
)
_KEY_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*|0|[1-9][0-9]*")
_UINT = r"(?:0|[1-9](?:_?[0-9])*)"
_POINT_FLOAT = rf"(?:{_UINT}\.|{_UINT}?\.[0-9](?:_?[0-9])*)"
_FLOAT = re.compile(
    rf"[+-]?(?:(?:{_UINT}|{_POINT_FLOAT})[eE][+-]?[0-9](?:_?[0-9])*|{_POINT_FLOAT}|[Ii][Nn][Ff]|[Nn][Aa][Nn])"
)
_INT = re.compile(rf"[+-]?{_UINT}")
_UNQUOTED_EXTRA = set("/-\\+.$%*@?|: \t_")
_ESCAPABLE = set("\\()[]{}:=, \t")
_STOP = set(",[]{}()=")


@dataclass(frozen=True, slots=True)
class Override:
    """One parsed command-line override.

    Attributes:
        op: ``set`` (``a.b=v``), ``add`` (``+a.b=v``), ``force`` (``++a.b=v``) or ``delete`` (``~a.b``).
        key: The dotted key, split (``("policy", "model_name")``).
        value: The typed value; for ``delete``, ``None`` unless ``~a.b=v`` names the value to delete.
        text: The override as given.
    """

    op: OverrideOp
    key: tuple[str, ...]
    value: Any = None
    text: str = ""

    @property
    def dotted_key(self) -> str:
        return ".".join(self.key)


class _ValueParser:
    """Recursive-descent parser for Hydra override values (primitives, quoted strings, lists, dicts)."""

    def __init__(self, override: str, text: str) -> None:
        self.override, self.text, self.pos = override, text, 0

    def fail(self, problem: str) -> ConfigError:
        where = f"at value position {self.pos}"
        return ConfigError(f"override {self.override!r}: {problem} ({where}); {_GRAMMAR}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_ws(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.pos += 1

    def parse(self) -> Any:
        if not self.text.strip():
            return ""
        value = self.element()
        self.skip_ws()
        if self.peek() == ",":
            raise self.fail(
                "a comma-separated value is a Hydra sweep (multirun), which rlfleet does not run; "
                "for a list write key=[a,b], for a string containing commas quote it: key='a,b'"
            )
        if self.peek():
            raise self.fail(f"unexpected {self.peek()!r}; quote a value that contains it")
        return value

    def element(self) -> Any:
        self.skip_ws()
        char = self.peek()
        if char == "[":
            return self.sequence()
        if char == "{":
            return self.mapping()
        if char in ("'", '"'):
            return self.quoted()
        return self.primitive()

    def sequence(self) -> list[Any]:
        self.pos += 1
        items: list[Any] = []
        self.skip_ws()
        if self.peek() == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.element())
            self.skip_ws()
            if self.peek() == "]":
                self.pos += 1
                return items
            if self.peek() != ",":
                raise self.fail("unclosed '[' or missing ',' between list items; write lists as [a,b,c]")
            self.pos += 1

    def mapping(self) -> dict[str, Any]:
        self.pos += 1
        items: dict[str, Any] = {}
        self.skip_ws()
        if self.peek() == "}":
            self.pos += 1
            return items
        while True:
            key = self.unquoted(in_dict_key=True)[0]  # Hydra dict keys are always strings
            self.skip_ws()
            if self.peek() != ":":
                raise self.fail("a dict item must be key: value; write dicts as {a: 1, b: x}")
            self.pos += 1
            items[key] = self.element()
            self.skip_ws()
            if self.peek() == "}":
                self.pos += 1
                return items
            if self.peek() != ",":
                raise self.fail("unclosed '{' or missing ',' between dict items; write dicts as {a: 1, b: x}")
            self.pos += 1

    def quoted(self) -> str:
        quote, self.pos, out = self.peek(), self.pos + 1, []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\\":
                run = len(self.text[self.pos :]) - len(self.text[self.pos :].lstrip("\\"))
                self.pos += run
                if self.peek() == quote:  # backslashes are only escapes in front of the quote
                    out.append("\\" * (run // 2))
                    if run % 2:
                        out.append(quote)
                        self.pos += 1
                    continue
                out.append("\\" * run)
                continue
            self.pos += 1
            if char == quote:
                return "".join(out)
            out.append(char)
        raise self.fail(f"unterminated {quote}-quoted string; close it with {quote}")

    def primitive(self) -> Any:
        raw, escaped = self.unquoted(in_dict_key=False)
        if self.peek() == "(":
            raise self.fail(
                "function calls (choice(), range(), glob(), ...) are Hydra sweep syntax, which rlfleet does "
                "not run; to set a string containing '(' quote it or escape it as \\("
            )
        return raw if escaped else _typed_primitive(raw)

    def unquoted(self, in_dict_key: bool) -> tuple[str, bool]:
        """Scan an unquoted run; return it with escapes resolved and outer blanks stripped, and whether
        it contained an escape (an escaped value is always a string)."""
        out: list[str] = []
        escaped, keep = False, 0  # keep: length of `out` without unescaped trailing blanks
        self.skip_ws()
        while (char := self.peek()) and not (char in _STOP or (in_dict_key and char == ":")):
            if char == "\\" and self.text[self.pos + 1 : self.pos + 2] in _ESCAPABLE:
                out.append(self.text[self.pos + 1])
                self.pos, escaped, keep = self.pos + 2, True, len(out)
            elif char == "$" and self.text.startswith("${", self.pos) and not in_dict_key:
                end = self.text.find("}", self.pos)
                if end < 0:
                    raise self.fail("unterminated interpolation '${'; close it with '}'")
                out.append(self.text[self.pos : end + 1])
                self.pos, keep = end + 1, len(out)
            elif char.isalnum() or char in _UNQUOTED_EXTRA:  # Hydra: ASCII only; a superset is harmless
                out.append(char)
                self.pos += 1
                keep = keep if char in " \t" else len(out)
            elif char in ("'", '"'):
                raise self.fail("a quoted string must be the whole value or list/dict item; quote all of it")
            else:
                raise self.fail(f"character {char!r} is not allowed in an unquoted value; quote the value")
        raw = "".join(out[:keep])
        if not raw and not escaped:
            raise self.fail("missing value; write '' for an empty string")
        return raw, escaped


def _typed_primitive(raw: str) -> Any:
    """Hydra's typing of an unquoted value: int, float, bool and null are case-insensitive keywords."""
    if _INT.fullmatch(raw):
        return int(raw)
    if _FLOAT.fullmatch(raw):
        return float(raw)
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return None if lowered == "null" else raw


def _parse_key(text: str, key_text: str) -> tuple[str, ...]:
    if not key_text:
        raise ConfigError(f"override {text!r}: the key is empty; {_GRAMMAR}")
    if "/" in key_text or "@" in key_text:
        raise ConfigError(
            f"override {text!r}: key {key_text!r} uses Hydra config-group or package syntax ('/' or '@'), "
            f"which rlfleet recipes do not have; {_GRAMMAR}"
        )
    segments = tuple(key_text.split("."))
    bad = [s for s in segments if not _KEY_SEGMENT.fullmatch(s)]
    if bad:
        raise ConfigError(
            f"override {text!r}: invalid key {key_text!r} (bad part {bad[0]!r}: parts are identifiers "
            f"[A-Za-z_][A-Za-z0-9_-]* or list indices joined by '.'); {_GRAMMAR}"
        )
    return segments


def parse_override(text: str) -> Override:
    """Parse one override (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``, ``~a.b=v``).

    Raises:
        ConfigError: the override does not follow the grammar; the message explains it.
    """
    if not isinstance(text, str):
        raise ConfigError(f"override {short_repr(text)}: {got(text)}, expected a string; {_GRAMMAR}")
    op: OverrideOp
    if text.startswith("++"):
        op, body = "force", text[2:]
    elif text.startswith("+"):
        op, body = "add", text[1:]
    elif text.startswith("~"):
        op, body = "delete", text[1:]
    else:
        op, body = "set", text
    if body[:1] in ("+", "~"):
        raise ConfigError(f"override {text!r}: too many or mixed prefixes (use one of +, ++, ~); {_GRAMMAR}")
    key_text, equals, value_text = body.partition("=")
    if not equals and op != "delete":
        raise ConfigError(f"override {text!r}: missing '=' between key and value; {_GRAMMAR}")
    key = _parse_key(text, key_text)
    if not equals:
        return Override("delete", key, None, text)
    return Override(op, key, _ValueParser(text, value_text).parse(), text)


def quote_override_value(text: str) -> str:
    """Quote a string so that ``key=<result>`` sets exactly ``text`` (for overrides built from paths etc.)."""
    escaped = re.sub(r"(\\*)('|\Z)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{escaped}'"


def _index(node: list[Any], segment: str, override: Override, upto: int) -> int:
    path = ".".join(override.key[:upto])
    if not segment.isdigit() or int(segment) >= len(node):
        raise ConfigError(
            f"override {override.text!r}: {path} is a list of {len(node)} items, so {segment!r} is not "
            f"a valid index; use an index 0..{len(node) - 1} or replace the whole list ({path}=[...])"
        )
    return int(segment)


def _walk(root: dict[str, Any], override: Override) -> dict[str, Any] | list[Any]:
    """The container holding the override's last key part; creates missing mappings unless deleting."""
    node: dict[str, Any] | list[Any] = root
    for depth, segment in enumerate(override.key[:-1], start=1):
        if isinstance(node, list):
            child = node[_index(node, segment, override, depth)]
        elif node.get(segment) is None and override.op != "delete":
            child = node[segment] = {}
        elif segment not in node:
            raise ConfigError(
                f"override {override.text!r}: cannot delete {override.dotted_key} because "
                f"{'.'.join(override.key[:depth])} is not in the config; nothing to delete, drop the override"
            )
        else:
            child = node[segment]
        if not isinstance(child, dict | list):
            path = ".".join(override.key[:depth])
            raise ConfigError(
                f"override {override.text!r}: {path} is {short_repr(child)} ({type(child).__name__}), not a "
                f"mapping, so it has no key {override.key[depth]!r}; check the key or replace {path} first"
            )
        node = child
    return node


def _delete(node: dict[str, Any] | list[Any], override: Override) -> None:
    last = override.key[-1]
    if isinstance(node, list):
        index: int | str = _index(node, last, override, len(override.key))
    elif last in node:
        index = last
    else:
        raise ConfigError(
            f"override {override.text!r}: cannot delete {override.dotted_key}, it is not in the config "
            "(after `defaults` and earlier overrides); nothing to delete, drop the override"
        )
    current = node[index]  # type: ignore[index]
    if override.value is not None and current != override.value:
        raise ConfigError(
            f"override {override.text!r}: {override.dotted_key} is {short_repr(current)}, not "
            f"{short_repr(override.value)}, so it is not deleted; write ~{override.dotted_key} to delete "
            "whatever it holds"
        )
    del node[index]  # type: ignore[arg-type]


def _apply(root: dict[str, Any], override: Override) -> None:
    node = _walk(root, override)
    if override.op == "delete":
        _delete(node, override)
        return
    last, value = override.key[-1], copy.deepcopy(override.value)
    if isinstance(node, list):
        node[_index(node, last, override, len(override.key))] = value
    elif isinstance(value, dict) and isinstance(node.get(last), dict):
        node[last] = deep_merge(node[last], value)  # Hydra merges a dict value into an existing dict
    else:
        node[last] = value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with ``overrides`` applied in order.

    Raises:
        ConfigError: listing every malformed or inapplicable override.
    """
    result = copy.deepcopy(raw)
    problems: list[str] = []
    for text in [overrides] if isinstance(overrides, str) else overrides:
        try:
            _apply(result, parse_override(text))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems, header=f"{len(problems)} invalid command-line override(s):")
    return result
