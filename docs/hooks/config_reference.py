"""MkDocs hook: the configuration reference, generated from the pydantic schema at build time.

``config-reference.md`` holds a marker; this hook replaces it with one table per section of
:class:`rlfleet.config.schema.MasterConfig` (key, type, default, description), walking nested models
recursively, so the page shows the schema the build imported and cannot drift from it. Registered under
``hooks:`` in ``mkdocs.yml``.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PAGE = "config-reference.md"
MARKER = "<!-- config-reference -->"

_BOUNDS = {
    annotated_types.Ge: ("ge", ">="),
    annotated_types.Gt: ("gt", ">"),
    annotated_types.Le: ("le", "<="),
    annotated_types.Lt: ("lt", "<"),
}


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """Replace the marker on the reference page with the generated tables."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the configuration reference has nowhere to go")
    from rlfleet.config.schema import MasterConfig

    return markdown.replace(MARKER, render(MasterConfig))


def render(root: type[BaseModel]) -> str:
    """Markdown for every section of ``root``: a heading and a table each, in schema order."""
    out: list[str] = []
    seen: dict[type[BaseModel], str] = {}
    _section(root, "", out, seen)
    return "\n".join(out)


def _section(model: type[BaseModel], path: str, out: list[str], seen: dict[type[BaseModel], str]) -> None:
    """A section's heading, docstring and table, then its sub-sections; at the root, the sections alone."""
    rows: list[str] = []
    children: list[tuple[str, FieldInfo, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        sub = _model_of(field.annotation)
        if sub is None:
            rows.append(_row(key, _type_text(field), _default(field), _describe(field)))
            continue
        children.append((key, field, sub))
        if sub in seen or not path:
            continue
        optional = " (optional: null by default)" if field.default is None else ""
        rows.append(_row(key, f"section [`{key}`](#{_anchor(key)})", "", _describe(field) + optional))
    if path:
        out.append(f"{'##' if '.' not in path else '###'} `{path}`\n")
        doc = _docstring(model)
        if doc:
            out.append(doc + "\n")
        if model.model_config.get("extra") == "allow":
            other = f"{path}.<name>"
            out.append(
                f"Any other key under `{path}` is allowed: a user's entry, [`{other}`](#{_anchor(other)}).\n"
            )
    shared_rows: list[str] = []
    for key, field, sub in children:
        if sub in seen:  # a model documented already (the teacher reuses the policy's schema)
            link = f"[`{seen[sub]}`](#{_anchor(seen[sub])})"
            or_null = " or null" if _allows_none(field.annotation) else ""
            if path:
                shared_rows.append(
                    _row(key, f"the schema of {link}{or_null}", _default(field), _describe(field))
                )
            else:
                out.append(f"## `{key}`\n")
                out.append(
                    f"Keys of {link} under `{key}.`{or_null} (default {_default(field)}): "
                    f"{_describe(field)}\n"
                )
        elif not path:
            seen[sub] = key
            _section(sub, key, out, seen)
    if rows or shared_rows:
        out.append("| key | type | default | description |\n|---|---|---|---|")
        out.extend(rows + shared_rows)
        out.append("")
    if path:
        for key, _field, sub in children:
            if sub not in seen:
                seen[sub] = key
                _section(sub, key, out, seen)
    if path == "env":
        _custom_environment(out, seen)


def _custom_environment(out: list[str], seen: dict[type[BaseModel], str]) -> None:
    """``env.<name>`` for a user's environment: the schema's extra keys, validated as CustomEnvConfig."""
    from rlfleet.config import schema

    custom = getattr(schema, "CustomEnvConfig", None)
    if isinstance(custom, type) and issubclass(custom, BaseModel) and custom not in seen:
        seen[custom] = "env.<name>"
        _section(custom, "env.<name>", out, seen)


def _row(key: str, type_text: str, default: str, description: str) -> str:
    return f"| `{key}` | {type_text} | {default} | {description} |"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``Model`` or ``Model | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        others = [a for a in typing.get_args(annotation) if a is not type(None) and a not in models]
        if len(models) == 1 and not others:
            return models[0]
    return None


def _allows_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _type_text(field: FieldInfo) -> str:
    text = f"`{_format_type(field.annotation)}`"
    bounds = [
        f"{sign} {getattr(m, attr)}"
        for m in field.metadata
        for cls, (attr, sign) in _BOUNDS.items()
        if isinstance(m, cls)
    ]
    return text + (", " + ", ".join(bounds) if bounds else "")


def _format_type(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_format_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_format_type(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, tuple):
        value = list(value)
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    return f"`{text}`"  # a pipe inside a code span does not split a table cell


def _describe(field: FieldInfo) -> str:
    return _escape(field.description or "")


def _docstring(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")  # a section's own docstring, never the base class's
    if not own:
        return ""
    first = inspect.cleandoc(own).split("\n\n", 1)[0]
    first = re.sub(r":(?:class|mod|data|func|meth|attr):`~?([^`]+)`", r"`\1`", first)
    return _escape(" ".join(first.split()))


def _escape(text: str) -> str:
    """Table-safe markdown: code spans kept as they are (a pipe in one does not split a cell), and outside
    them ``<``, ``>``, ``|``, ``*``, ``_``, ``[``, ``]`` escaped, so a description is shown as written."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        part = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = re.sub(r"([|*_\[\]])", r"\\\1", part)
    return "`".join(parts)


def _anchor(key: str) -> str:
    """The id MkDocs' toc extension gives the heading `` `key` ``."""
    return re.sub(r"[^\w-]", "", key.lower().replace(" ", "-"))
