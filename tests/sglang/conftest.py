"""Fixtures for the SGLang HiCache backend tests: real kvtier daemon processes.

These tests run in .venv-sglang (``make test-sglang``), where SGLang is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``), started on a private socket by the
engine tests' shared fixtures.
"""

from __future__ import annotations

from tests.enginedaemon import EngineDaemon, daemon, workdir

Daemon = EngineDaemon
#: the shared fixtures (daemon, workdir), for this directory's tests
__all__ = ["daemon", "workdir"]
