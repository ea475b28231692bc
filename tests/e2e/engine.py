"""One vLLM engine, in a process of its own, generating greedily on the CPU.

    python -m tests.e2e.engine spec.json

The spec names the model directory, kvtier's socket (null: no offload at
all, the control) and the prompts (token ids), run one after another. For
each prompt one line of JSON goes to stdout: the generated token ids and
vLLM's ``num_cached_tokens`` (prompt tokens it did not compute) and the
seconds ``generate`` took, after ``MARK``. ``kv_cache_bytes``,
``cpu_tier_bytes`` and ``max_model_len`` size the engine. With
``"pause_after": [i, ...]`` it says ``{"paused": i}`` after prompt ``i``
and waits for a line on stdin before going on.
"""

from __future__ import annotations

import json
import os
import sys
import time
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


def main(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("socket"):
        transfer = KVTransferConfig(
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
                    }
                ],
            },
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK,
        dtype="float32",
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", KV_CACHE_BYTES),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
        seed=0,
    )
    params = SamplingParams(
        temperature=0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False
    )
    for i, ids in enumerate(spec["prompts"]):
        started = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        line = {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0,
            "seconds": seconds,
        }
        say(line)
        if i in spec.get("pause_after", ()):
            say({"paused": i})
            sys.stdin.readline()
    del llm


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f))
