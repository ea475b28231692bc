"""One vLLM engine, in a process of its own, generating greedily on the CPU.

    python -m tests.e2e.engine spec.json

The spec names the model directory, kvtier's socket (null: no offload at
all, the control), the way to it (``"via"``: ``"vllm"``, vLLM's
OffloadingConnector with kvtier's tier, the default; or ``"lmcache"``,
vLLM's LMCacheConnectorV1 with kvtier's LMCache connector) and the prompts
(token ids), run one after another. For
each prompt one line of JSON goes to stdout: the generated token ids and
vLLM's ``num_cached_tokens`` (prompt tokens it did not compute) and the
seconds ``generate`` took, after ``MARK``. ``kv_cache_bytes``,
``cpu_tier_bytes`` and ``max_model_len`` size the engine; ``tier_options``
are kvtier's vLLM tier's own (docs/vllm.md). With
``"timeline": true`` each line has the prompt's
timeline too (tests/e2e/timeline.py). With
``"pause_after": [i, ...]`` it says ``{"paused": i}`` after prompt ``i``
and waits for a line on stdin before going on.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: tokens per block: vLLM's block and the offloaded block alike
BLOCK = 32
#: the engine's own KV cache (64 KiB blocks: 128 of them) and its CPU primary tier (64)
KV_CACHE_BYTES = 8 << 20
CPU_TIER_BYTES = 4 << 20


#: what starts the lines meant for the test (vLLM writes to stdout too)
MARK = "E2E "


def say(line: dict[str, Any]) -> None:
    print(MARK + json.dumps(line), flush=True)


#: LMCache's configuration (LMCache 0.5.6): chunks of one vLLM block, a local
#: CPU cache in front of kvtier as large as the CPU tier on the vLLM path, and
#: the content hash a fleet shares (LMCache's default, Python's ``hash``,
#: differs between processes)
LMCACHE_CONFIG = """\
chunk_size: {block}
local_cpu: true
max_local_cpu_size: {local_gib}
pre_caching_hash_algorithm: sha256_cbor_64bit
storage_plugins: ["kvtier"]
extra_config:
  storage_plugin.kvtier.module_path: kvtier.integrations.lmcache
  storage_plugin.kvtier.class_name: KvtierBackend
  kvtier.socket: {socket}
"""


def transfer_config(spec: dict[str, Any], workdir: str) -> Any:
    """vLLM's KV transfer configuration for ``spec``: None without kvtier.
    (LMCache's configuration file is written in ``workdir``.)"""
    from vllm.config import KVTransferConfig

    if not spec.get("socket"):
        return None
    if spec.get("via", "vllm") == "lmcache":
        config = os.path.join(workdir, "lmcache.yaml")
        with open(config, "w") as f:
            f.write(
                LMCACHE_CONFIG.format(
                    block=BLOCK, local_gib=CPU_TIER_BYTES / (1 << 30), socket=spec["socket"]
                )
            )
        os.environ["LMCACHE_CONFIG_FILE"] = config
        os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
        return KVTransferConfig(
            kv_connector="CpuLMCacheConnector",
            kv_connector_module_path="tests.e2e.lmcache_cpu",
            kv_role="kv_both",
        )
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "CpuTieringSpec",
            "spec_module_path": "tests.e2e.offload",
            "cpu_bytes_to_use": spec.get("cpu_tier_bytes", CPU_TIER_BYTES),
            "block_size": BLOCK,
            "secondary_tiers": [
                {
                    "type": "KvtierTier",
                    "module_path": "kvtier.integrations.vllm",
                    "socket_path": spec["socket"],
                    **spec.get("tier_options", {}),
                }
            ],
        },
    )


def make_engine(spec: dict[str, Any], workdir: str) -> Any:
    from vllm import LLM

    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK,
        dtype="float32",
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", KV_CACHE_BYTES),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_transfer_config=transfer_config(spec, workdir),
        seed=0,
    )


def main(spec: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    timeline: ModuleType | None = None
    if spec.get("timeline"):  # (benchmarks/ttft.py: where the time goes)
        timeline = importlib.import_module("tests.e2e.timeline")
        timeline.install()
    with tempfile.TemporaryDirectory(prefix="kvt-engine-") as workdir:
        llm = make_engine(spec, workdir)
    params = SamplingParams(
        temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False
    )
    #: per prompt (its index as a string), the request's kv_transfer_params
    transfer = spec.get("kv_transfer_params", {})
    for i, ids in enumerate(spec["prompts"]):
        if timeline is not None:
            timeline.take()
        started = time.perf_counter()
        asked = params
        if str(i) in transfer:
            asked = params.clone()
            asked.extra_args = {"kv_transfer_params": transfer[str(i)]}
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], asked, use_tqdm=False)
        seconds = time.perf_counter() - started
        line = {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0,
            "seconds": seconds,
        }
        if timeline is not None:
            line["timeline"] = timeline.summary(timeline.take(), started)
        say(line)
        if i in spec.get("pause_after", ()):
            say({"paused": i})
            sys.stdin.readline()
    # Shut the engine down as a server does (its connectors' threads end):
    # LMCache's threads would otherwise keep the process from exiting.
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
