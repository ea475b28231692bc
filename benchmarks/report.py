"""A benchmark's table, printed and (with ``--markdown``) written where the docs include it."""

from __future__ import annotations

from pathlib import Path


def publish(lines: list[str], markdown: Path | None) -> None:
    """Print ``lines``; write them to ``markdown`` too when it is given."""
    text = "\n".join(lines)
    print(text)
    if markdown is not None:
        markdown.write_text(text + "\n")
