"""The model the end-to-end tests and benchmark run: a Llama of random
weights made here with transformers from a fixed seed (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path


def make_model(path: Path, *, layers: int = 2, hidden: int = 128) -> Path:
    """A Llama of random weights from a fixed seed, saved to ``path``: heads
    of dimension 32 (the CPU attention backend's smallest), float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path
