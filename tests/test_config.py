from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.config import (
    GiB,
    MiB,
    auto_copy_threads,
    auto_ram_capacity,
    load_config,
    render_toml,
)
from kvtier.defaults import DEFAULT_METRICS_PORT, default_socket_path
from kvtier.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)


def test_embedded_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    config = load_config()
    assert config.server.socket_path == tmp_path / "kvtier" / "kvtier.sock"
    assert config.metrics.host == "127.0.0.1"
    assert config.metrics.port == DEFAULT_METRICS_PORT
    assert config.server.max_block_bytes == 16 * MiB
    assert config.ram.capacity == "auto"


def test_socket_fallback_without_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_socket_path() == Path(f"/tmp/kvtier-{os.getuid()}/kvtier.sock")


def test_auto_ram_capacity_is_capped() -> None:
    assert auto_ram_capacity(400 * GiB) == 16 * GiB
    assert auto_ram_capacity(8 * GiB) == 2 * GiB
    assert auto_ram_capacity(10 * MiB) == 64 * MiB


def test_region_copies_run_on_the_loop_on_small_machines() -> None:
    assert [auto_copy_threads(n) for n in (1, 2, 3, 4, 12, 64)] == [0, 0, 1, 2, 6, 8]
    config = load_config(None, {"shared": {"copy_threads": 3}})
    assert config.shared.copy_thread_count() == 3
    auto = load_config(None, {}).shared
    assert auto.copy_threads == "auto"
    assert auto.copy_thread_count() == auto_copy_threads(len(os.sched_getaffinity(0)))


def test_precedence_cli_over_env_over_toml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text('[ram]\ncapacity = "1GiB"\n[metrics]\nport = 1111\nhost = "0.0.0.0"\n')
    config = load_config(toml)
    assert config.ram.capacity == GiB
    assert (config.metrics.port, config.metrics.host) == (1111, "0.0.0.0")

    monkeypatch.setenv("KVTIER_METRICS__PORT", "2222")
    assert load_config(toml).metrics.port == 2222
    assert load_config(toml, {"metrics": {"port": 3333}}).metrics.port == 3333
    assert load_config(toml, {"metrics": {"port": 3333}}).metrics.host == "0.0.0.0"


def test_kvtier_config_env_names_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text("[server]\nmax_key_bytes = 64\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(toml))
    assert load_config().server.max_key_bytes == 64


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[ram]\ncapacity = "lots"\n', "ram.capacity"),
        ("[ram]\ncapasity = 5\n", "ram.capasity: Extra inputs are not permitted"),
        ("[server]\nmax_key_bytes = 0\n", "server.max_key_bytes"),
        ("[metrics]\nport = 70000\n", "metrics.port"),
        ('[server]\nmax_block_bytes = "128MiB"\n', "must fit in one frame"),
        ("[server]\nlookup_slice = 0.00005\n", "lookup_slice is 0 or 0.0001 to 0.1 seconds"),
        ("[server]\nlookup_slice = 1\n", "server.lookup_slice"),
        ("[shared]\ncopy_threads = -1\n", "shared.copy_threads"),
        ("[shared]\ncopy_threads = 65\n", "shared.copy_threads"),
        ('[shared]\ncopy_threads = "many"\n', "shared.copy_threads"),
        ("[bogus]\nx = 1\n", "bogus"),
        ("[ram\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, fragment: str) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        load_config(toml)
    assert fragment in str(info.value)


def test_bad_env_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_RAM__CAPACITY", "-5")
    with pytest.raises(ConfigError, match=r"ram\.capacity"):
        load_config()


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_rendered_config_loads_back(tmp_path: Path) -> None:
    config = load_config(None, {"ram": {"capacity": "3GiB"}})
    toml = tmp_path / "round.toml"
    toml.write_text(render_toml(config))
    assert load_config(toml) == config


def test_example_config_in_deploy_is_valid() -> None:
    root = Path(__file__).resolve().parent.parent
    load_config(root / "deploy" / "kvtier.toml")
