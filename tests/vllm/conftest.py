"""Fixtures for the vLLM tier tests: a real kvtier daemon process.

These tests run in .venv-vllm (``make test-vllm``), where vLLM is installed
and kvtier only as a client; the daemon is the main venv's ``kvtier serve``
(``KVTIER_SERVE``), started here on a private socket.

vLLM builds its configuration from a Hugging Face model config. The tests
write a tiny one (no weights, no tokenizer) into a private Hugging Face cache
and run offline, before vLLM is imported, so nothing reaches for the hub.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enginedaemon import EngineDaemon, start, workdir

ROOT = Path(__file__).resolve().parents[2]

MODEL = "kvtier-test/tiny-llama"
_REVISION = "0" * 40
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _write_hf_cache(home: Path) -> Path:
    """MODEL in the Hugging Face hub cache layout under home; its snapshot."""
    repo = home / "hub" / ("models--" + MODEL.replace("/", "--"))
    snapshot = repo / "snapshots" / _REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_REVISION)
    (snapshot / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    return snapshot


# Read by huggingface_hub when it is first imported: set before any test
# module imports vLLM.
_HF_HOME = Path(tempfile.mkdtemp(prefix="kvt-hf-", dir="/tmp"))
_HF_SNAPSHOT = _write_hf_cache(_HF_HOME)
os.environ["HF_HOME"] = str(_HF_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session")
def hf_model() -> Iterator[Path]:
    """The snapshot directory of the offline model; removed after the run."""
    yield _HF_SNAPSHOT
    shutil.rmtree(_HF_HOME, ignore_errors=True)


Daemon = EngineDaemon
#: the engine tests' shared fixture (a private directory), for this directory's tests
__all__ = ["workdir"]


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-vllm-", dir="/tmp"))
    config = tmp / "kvtier.toml"
    config.write_text('[[remote_tiers]]\nkind = "memory"\nname = "mem"\n')
    d = start(tmp, "--config", str(config), "--no-disk", "--ram-capacity", "256MiB")
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
