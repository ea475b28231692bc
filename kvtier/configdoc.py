"""The configuration reference, generated from the settings models themselves.

Each setting's meaning is the ``#:`` comment above its field in
:mod:`kvtier.config`; its type, default and bounds come from the pydantic
model. ``kvtier config reference`` prints the page; docs/configuration-
reference.md is its output, and a test fails when the two differ.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvtier import config

#: the sections in the order of the page: (TOML table, model)
SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("[server]", config.ServerConfig),
    ("[ram]", config.RamConfig),
    ("[shared]", config.SharedConfig),
    ("[disk]", config.DiskConfig),
    ("[lookup]", config.LookupConfig),
    ('[[remote_tiers]] kind = "s3"', config.S3TierConfig),
    ("[peer]", config.PeerConfig),
    ("[metrics]", config.MetricsConfig),
    ("[events]", config.EventsConfig),
    ("[namespaces.<name>]", config.NamespaceConfig),
    ("[log]", config.LogConfig),
]

HEADER = """\
# Configuration reference

Generated from the settings models by `kvtier config reference` (a test
fails when this page and the code differ); see
[configuration.md](configuration.md) for where settings come from (file,
`KVTIER_<SECTION>__<KEY>` environment variables, flags) and `kvtier config
check` to validate a file. Sizes accept `"512MiB"`, `"8GiB"` or bytes.
"""


def comments(model: type[BaseModel]) -> dict[str, str]:
    """The ``#:`` comment block above each field of ``model``'s class body."""
    lines = textwrap.dedent(inspect.getsource(model)).splitlines()
    out: dict[str, str] = {}
    for node in ast.parse("\n".join(lines)).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#:"):
            block.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        out[node.target.id] = " ".join(block)
    return out


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f'"{n // size}{unit}"'
    return str(n)


def _default(name: str, info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed at start)"
    if info.default is PydanticUndefined:
        return "required"
    value: Any = info.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int) and name.endswith("_mode"):
        return f'"0{value:o}"'
    if isinstance(value, int) and (name.endswith("_bytes") or name == "min_block"):
        return _size(value)
    return f"{value}"


def _bounds(info: FieldInfo) -> str:
    names = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}
    parts = []
    for meta in info.metadata:
        for attr, sign in names.items():
            bound = getattr(meta, attr, None)
            if bound is not None:
                parts.append(f"{sign} {bound}")
    return ", ".join(parts)


def _strip_annotated(text: str) -> str:
    """``Annotated[X, validators...]`` -> ``X`` (validators print memory addresses)."""
    while (start := text.find("Annotated[")) >= 0:
        depth, i = 0, start + len("Annotated[")
        inner_start = i
        comma = -1
        while i < len(text):
            ch = text[i]
            if ch == "[":
                depth += 1
            elif ch == "]":
                if depth == 0:
                    break
                depth -= 1
            elif ch == "," and depth == 0 and comma < 0:
                comma = i
            i += 1
        text = text[:start] + text[inner_start:comma] + text[i + 1 :]
    return text


def _type(info: FieldInfo) -> str:
    text = str(info.annotation).replace("typing.", "").replace("pathlib.", "")
    text = _strip_annotated(text).replace("pydantic.types.SecretStr", "secret")
    text = re.sub(r"Optional\[([^\]]+)\]", r"\1 or None", text)
    text = text.replace("<class '", "").replace("'>", "").replace("pydantic.types.ByteSize", "size")
    # A capacity parses sizes ("8GiB") before it validates; a count does not.
    sized = any(isinstance(m, BeforeValidator) for m in info.metadata)
    text = text.replace(
        "Union[int, Literal['auto']]", 'size or "auto"' if sized else 'int or "auto"'
    )
    text = re.sub(
        r"Literal\[([^\]]*)\]",
        lambda m: " or ".join(f'"{v.strip()}"' for v in m.group(1).replace("'", "").split(",")),
        text,
    )
    return text.replace(" | ", " or ").replace("|", "or")


def render() -> str:
    out = [HEADER]
    for table, model in SECTIONS:
        doc = inspect.getdoc(model)
        out.append(f"## `{table}`\n")
        if doc and model.__doc__ is not None and "__" not in doc:
            out.append(doc.strip() + "\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        notes = comments(model)
        for name, info in model.model_fields.items():
            bounds = _bounds(info)
            kind = _type(info) + (f" ({bounds})" if bounds else "")
            meaning = notes.get(name, "").replace("|", "\\|")
            out.append(f"| `{name}` | {kind} | {_default(name, info)} | {meaning} |")
        out.append("")
    return "\n".join(out)


def missing() -> list[str]:
    """Settings without a ``#:`` comment (the page would not say what they do)."""
    return [
        f"{table} {name}"
        for table, model in SECTIONS
        for name, text in comments(model).items()
        if not text and name != "kind"
    ]
