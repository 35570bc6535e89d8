"""Tiny Hugging Face checkpoint folders with random weights, in the real layouts of each family.

    tensors = write_bert(tmp_path / "minilm", prefix="")           # sentence-transformers' MiniLM names
    tensors = write_llama(tmp_path / "qwen", model_type="qwen2", bias=True, num_kv_heads=2, shards=3)

Each writer returns the whole state dict it wrote (tensor name -> tensor) so that a test can build
its own reference from the same weights. ``block(tensors, ...)`` picks one layer's attention weights
out of it under family-neutral keys (q, k, v, o, q_bias, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, MAX_POS = 32, 128


def _rand(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _save(folder: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int, dtype: torch.dtype):
    """config.json + model.safetensors, or ``shards`` files model-0000i-of-0000n.safetensors + index json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    # round-robin, so that one layer's q/k/v/o land in different files
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        part = {n: tensors[n] for n in names if weight_map[n] == file}
        save_file(part, str(folder / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_bert(
    folder: Path,
    *,
    hidden_size: int = 40,
    num_heads: int = 5,
    num_layers: int = 2,
    prefix: str = "bert.",
    model_type: str = "bert",
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config_extra: dict | None = None,
) -> dict[str, torch.Tensor]:
    """A BertModel checkpoint (prefix "bert." as BertFor*; "" as sentence-transformers' all-MiniLM-L6-v2)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, std = hidden_size, 2 * hidden_size, 1.5 / hidden_size**0.5
    t: dict[str, torch.Tensor] = {
        "embeddings.word_embeddings.weight": _rand(gen, VOCAB, h, std=1.0),
        "embeddings.position_embeddings.weight": _rand(gen, MAX_POS, h, std=1.0),
        "embeddings.token_type_embeddings.weight": _rand(gen, 2, h, std=1.0),
        "embeddings.LayerNorm.weight": torch.ones(h),
        "embeddings.LayerNorm.bias": torch.zeros(h),
    }
    for i in range(num_layers):
        p = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            t[p + f"attention.self.{proj}.weight"] = _rand(gen, h, h, std=std)
            t[p + f"attention.self.{proj}.bias"] = _rand(gen, h, std=0.1)
        t[p + "attention.output.dense.weight"] = _rand(gen, h, h, std=std)
        t[p + "attention.output.dense.bias"] = _rand(gen, h, std=0.1)
        t[p + "attention.output.LayerNorm.weight"] = torch.ones(h)
        t[p + "attention.output.LayerNorm.bias"] = torch.zeros(h)
        t[p + "intermediate.dense.weight"] = _rand(gen, inter, h, std=std)
        t[p + "intermediate.dense.bias"] = torch.zeros(inter)
        t[p + "output.dense.weight"] = _rand(gen, h, inter, std=std)
        t[p + "output.dense.bias"] = torch.zeros(h)
        t[p + "output.LayerNorm.weight"] = torch.ones(h)
        t[p + "output.LayerNorm.bias"] = torch.zeros(h)
    t["pooler.dense.weight"] = _rand(gen, h, h, std=std)
    t["pooler.dense.bias"] = torch.zeros(h)
    tensors = {prefix + k: v for k, v in t.items()}
    arch = {"bert": "BertModel", "roberta": "RobertaModel"}.get(model_type, "BertModel")
    config = {
        "architectures": [arch], "model_type": model_type, "hidden_size": h, "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers, "intermediate_size": inter, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12,
        "max_position_embeddings": MAX_POS, "type_vocab_size": 2, "vocab_size": VOCAB,
        "position_embedding_type": "absolute", "pad_token_id": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **(config_extra or {}),
    }
    _save(folder, tensors, config, shards, dtype)
    return {k: v.to(dtype) for k, v in tensors.items()}


def write_llama(
    folder: Path,
    *,
    hidden_size: int = 64,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    num_layers: int = 2,
    prefix: str = "model.",
    model_type: str = "llama",
    bias: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config_extra: dict | None = None,
) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM-style checkpoint; ``bias=True`` adds Qwen2's q/k/v biases (o_proj has none)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, std = hidden_size, 2 * hidden_size, 1.5 / hidden_size**0.5
    d = head_dim or h // num_heads
    t: dict[str, torch.Tensor] = {"embed_tokens.weight": _rand(gen, VOCAB, h, std=1.0)}
    for i in range(num_layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = _rand(gen, num_heads * d, h, std=std)
        t[p + "self_attn.k_proj.weight"] = _rand(gen, num_kv_heads * d, h, std=std)
        t[p + "self_attn.v_proj.weight"] = _rand(gen, num_kv_heads * d, h, std=std)
        t[p + "self_attn.o_proj.weight"] = _rand(gen, h, num_heads * d, std=1.5 / (num_heads * d) ** 0.5)
        if bias:
            t[p + "self_attn.q_proj.bias"] = _rand(gen, num_heads * d, std=0.3)
            t[p + "self_attn.k_proj.bias"] = _rand(gen, num_kv_heads * d, std=0.3)
            t[p + "self_attn.v_proj.bias"] = _rand(gen, num_kv_heads * d, std=0.3)
        t[p + "mlp.gate_proj.weight"] = _rand(gen, inter, h, std=std)
        t[p + "mlp.up_proj.weight"] = _rand(gen, inter, h, std=std)
        t[p + "mlp.down_proj.weight"] = _rand(gen, h, inter, std=std)
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    t["norm.weight"] = torch.ones(h)
    tensors = {prefix + k: v for k, v in t.items()}
    if prefix == "model.":  # a *ForCausalLM checkpoint also holds the LM head, outside the prefix
        tensors["lm_head.weight"] = _rand(gen, VOCAB, h, std=std)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    config = {
        "architectures": [arch], "model_type": model_type, "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu", "max_position_embeddings": MAX_POS, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "rope_theta": rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": False,
        "attention_dropout": 0.0, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if model_type == "llama":
        config["attention_bias"] = bias
    if model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    config.update(config_extra or {})
    _save(folder, tensors, config, shards, dtype)
    return {k: v.to(dtype) for k, v in tensors.items()}


def _find(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor called ``name`` under any prefix ("", "bert.", "model.", ...), or None."""
    return next((t for n, t in tensors.items() if n == name or n.endswith("." + name)), None)


def block(tensors: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor | None]:
    """Layer ``index``'s attention weights from a state dict of either family, family-neutral keys."""
    stems = {
        "q": ("attention.self.query", "self_attn.q_proj"),
        "k": ("attention.self.key", "self_attn.k_proj"),
        "v": ("attention.self.value", "self_attn.v_proj"),
        "o": ("attention.output.dense", "self_attn.o_proj"),
    }
    out: dict[str, torch.Tensor | None] = {}
    for key, (bert, llama) in stems.items():
        for stem in (f"encoder.layer.{index}.{bert}", f"layers.{index}.{llama}"):
            weight = _find(tensors, stem + ".weight")
            if weight is not None:
                out[key], out[key + "_bias"] = weight, _find(tensors, stem + ".bias")
    return out
