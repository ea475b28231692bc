"""The configuration's value types and the base of every section. Pydantic only.

Sizes (``"8GiB"``, ints), capacities (a size or ``"auto"``), socket modes
(0600 or 0660, never open to others) and :class:`Section`, which refuses
unknown keys and validates assignments (a live reload sets fields).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

from kvtier.sizes import parse_size


def _capacity(value: Any) -> Any:
    return value if value == "auto" else parse_size(value)


def _size_or_zero(value: Any) -> Any:
    return 0 if value == 0 else parse_size(value)


def _socket_mode(value: Any) -> Any:
    mode = int(value, 8) if isinstance(value, str) else value
    if not isinstance(mode, int) or mode & ~0o660 or mode & 0o600 != 0o600:
        raise ValueError(
            f"socket_mode must give the owner read and write and nothing to others "
            f"(0600 or 0660), got {value!r}"
        )
    return mode


#: a Unix socket's permission bits: owner rw, optionally group rw, never others
SocketMode = Annotated[int, BeforeValidator(_socket_mode)]

#: a byte count (``8GiB`` or an int), or "auto"
Capacity = Annotated[int | Literal["auto"], BeforeValidator(_capacity)]
#: a byte count, 0 allowed
ByteCount = Annotated[int, BeforeValidator(_size_or_zero)]


class Section(BaseModel):
    """A table of the configuration: unknown keys are errors; assignments validate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
