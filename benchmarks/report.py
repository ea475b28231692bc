"""A benchmark's table, printed and (with ``--markdown``) written where the docs include it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """The machine a figure was measured on: cores, CPU model, kernel."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}"


def publish(lines: list[str], markdown: Path | None) -> None:
    """Print ``lines``; write them to ``markdown`` too when it is given."""
    text = "\n".join(lines)
    print(text)
    if markdown is not None:
        markdown.write_text(text + "\n")
