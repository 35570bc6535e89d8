"""The model families: which config.json belongs to which, the tensor names each reads for its
attention block, their head counts, and the Llama family's rotary position embedding (RoPE).

Families and the tensor names they read (a ``bert.``/``roberta.``/``model.``/``<model_type>.`` prefix
is optional):
    bert   encoder.layer.{i}.attention.self.{query,key,value}.{weight,bias}
           encoder.layer.{i}.attention.output.dense.{weight,bias}
    llama  layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias where transformers' module has one:
           Qwen2's q/k/v, Llama's four with attention_bias, Mistral's none)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kernels
from service.layers.layer import LayerConfigError, LayerInfo, Weights

# config.json model_type -> family. Each listed type has exactly the attention block computed here.
FAMILY_OF = {
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra"), "bert"),
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2"), "llama"),
}
# architectures[0] prefix -> model_type, for a config.json without model_type (longest prefixes first)
ARCH_PREFIX = {"XLMRoberta": "xlm-roberta", "Roberta": "roberta", "Camembert": "camembert",
               "Electra": "electra", "Bert": "bert", "Llama": "llama", "Mistral": "mistral",
               "Mixtral": "mixtral", "Qwen2": "qwen2"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of the Llama family, in HF's rotate-half convention (``apply_rotary_pos_emb``)."""

    inv_freq: torch.Tensor  # float32 (head_dim // 2,): theta^(-2j/head_dim), after rope_scaling

    def to(self, device: torch.device) -> Rope:
        return Rope(self.inv_freq.to(device))

    def apply(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """t: (B, H, N, D), positions: int64 (B, N) -> t rotated, in t's dtype (computed in float32)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (B, N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, N, D)
        tf = t.to(torch.float32)
        x1, x2 = tf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half
        return (tf * emb.cos() + rotated * emb.sin()).to(t.dtype)



def model_type_of(config: dict[str, Any], folder: Path, where: str) -> str:
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type is None and isinstance(archs, list):
        # a class of the family itself ("LlamaForCausalLM", "BertModel"), not one whose name extends
        # it ("Llama4ForCausalLM", "Qwen2MoeForCausalLM": other attention)
        model_type = next((t for a in archs for p, t in ARCH_PREFIX.items()
                           if str(a) == p + "Model" or str(a).startswith(p + "For")), None)
    if not isinstance(model_type, str) or model_type not in FAMILY_OF:
        raise LayerConfigError(
            f"{where}: unknown model family (model_type={config.get('model_type')!r}, "
            f"architectures={archs!r}) in {folder / 'config.json'}; "
            f"supported model types: {', '.join(FAMILY_OF)}"
        )
    return model_type


def _positive(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayerConfigError(f"{where}: config.json {key} must be a positive integer, got {value!r}")
    return value


def _heads(config: dict[str, Any], where: str, *, llama: bool) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim) from config.json, checked for consistency."""
    hidden = _positive(config, "hidden_size", where)
    heads = _positive(config, "num_attention_heads", where)
    kv_heads = _positive(config, "num_key_value_heads", where, heads) if llama else heads
    if heads % kv_heads:
        raise LayerConfigError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    if llama and config.get("head_dim") is not None:
        head_dim = _positive(config, "head_dim", where)
    elif hidden % heads:
        raise LayerConfigError(
            f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
        )
    else:
        head_dim = hidden // heads
    if head_dim > kernels.MAX_HEAD_DIM:
        raise LayerConfigError(f"{where}: head_dim={head_dim} is over the kernels' {kernels.MAX_HEAD_DIM}")
    return hidden, heads, kv_heads, head_dim


def load_bert(name, config, model_type, index, store, where):
    pos_type = config.get("position_embedding_type") or "absolute"
    if pos_type != "absolute":
        raise LayerConfigError(
            f"{where}: position_embedding_type={pos_type!r} changes the attention scores; "
            "only 'absolute' (outside the attention block) is supported"
        )
    hidden, heads, _, head_dim = _heads(config, where, llama=False)
    stem = f"encoder.layer.{index}.attention."
    # a checkpoint with a head keeps the base model under its base_model_prefix: "bert.", "roberta."
    # (RoBERTa, XLM-RoBERTa and CamemBERT alike), "electra."
    prefix = store.prefix(stem + "self.query.weight", ("", "bert.", "roberta.", f"{model_type}.", "model."))
    stem = prefix + stem
    inner = heads * head_dim
    names = {  # Weights field -> (tensor name, shape that config.json implies)
        "q": (stem + "self.query.weight", (inner, hidden)), "q_bias": (stem + "self.query.bias", (inner,)),
        "k": (stem + "self.key.weight", (inner, hidden)), "k_bias": (stem + "self.key.bias", (inner,)),
        "v": (stem + "self.value.weight", (inner, hidden)), "v_bias": (stem + "self.value.bias", (inner,)),
        "o": (stem + "output.dense.weight", (hidden, inner)),
        "o_bias": (stem + "output.dense.bias", (hidden,)),
    }
    weights = Weights(**store.read(names, optional=()))
    return LayerInfo(name, "bert", hidden, heads, heads, head_dim, weights.q.dtype), weights, None


def load_llama(name, config, model_type, index, store, where):
    hidden, heads, kv_heads, head_dim = _heads(config, where, llama=True)
    rope = _rope(config, model_type, head_dim, where)
    stem = f"layers.{index}.self_attn."
    prefix = store.prefix(stem + "q_proj.weight", ("", "model.", f"{model_type}."))
    stem = prefix + stem
    if store.has(stem + "q_norm.weight") or store.has(stem + "k_norm.weight"):
        raise LayerConfigError(f"{where}: {stem}q_norm/k_norm (Qwen3-style norms) are not supported")
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    names = {
        "q": (stem + "q_proj.weight", (q_out, hidden)), "q_bias": (stem + "q_proj.bias", (q_out,)),
        "k": (stem + "k_proj.weight", (kv_out, hidden)), "k_bias": (stem + "k_proj.bias", (kv_out,)),
        "v": (stem + "v_proj.weight", (kv_out, hidden)), "v_bias": (stem + "v_proj.bias", (kv_out,)),
        "o": (stem + "o_proj.weight", (hidden, q_out)), "o_bias": (stem + "o_proj.bias", (hidden,)),
    }
    biased = _llama_biases(config, model_type, where)
    names = {field: entry for field, entry in names.items() if not field.endswith("_bias") or field in biased}
    weights = Weights(**store.read(names, optional=()))  # (a bias the module has is no option)
    info = LayerInfo(name, "llama", hidden, heads, kv_heads, head_dim, weights.q.dtype)
    return info, weights, rope


def _llama_biases(config: dict[str, Any], model_type: str, where: str) -> tuple[str, ...]:
    """The projections whose bias transformers' module of ``model_type`` has: a checkpoint's bias
    tensors elsewhere are left unread, as transformers leaves them (a bias it would not add)."""
    if model_type == "qwen2":
        return ("q_bias", "k_bias", "v_bias")
    if model_type in ("mistral", "mixtral"):
        return ()
    flag = config.get("attention_bias", False)
    if not isinstance(flag, bool):
        raise LayerConfigError(f"{where}: attention_bias must be true or false, got {flag!r}")
    return ("q_bias", "k_bias", "v_bias", "o_bias") if flag else ()


def sliding_window(config: dict[str, Any], model_type: str, index: int, where: str = "config.json") -> int | None:
    """This layer's attention window as HF computes it, or None for full attention. A config.json
    without the key takes the config class's default, as transformers does (4096 for Mistral, and
    for Qwen2 with use_sliding_window; none for Mixtral)."""
    window = config.get("sliding_window", DEFAULT_WINDOW.get(model_type))
    if not window:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise LayerConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and index < len(layer_types):
        active = layer_types[index] == "sliding_attention"
    elif model_type == "qwen2":
        first = config.get("max_window_layers") or 0
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise LayerConfigError(f"{where}: max_window_layers must be a non-negative integer, got {first!r}")
        active = bool(config.get("use_sliding_window")) and index >= first
    else:
        active = model_type in ("mistral", "mixtral")
    return int(window) if active else None


# transformers' config classes' default sliding_window, where a config.json gives no such key
DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096}
# transformers' default rope_theta per model type, where a config.json gives none (its config classes')
DEFAULT_THETA = {"mixtral": 1e6}


def _rope(config: dict[str, Any], model_type: str, head_dim: int, where: str) -> Rope:
    """inv_freq of HF's plain RoPE, and of its "linear" and "llama3" rope_scaling types, as
    transformers resolves a config.json (``PreTrainedConfig.convert_rope_params_to_dict``): the
    RoPE parameters are ``rope_scaling`` when it is given, else ``rope_parameters``; theta is theirs,
    else the top-level ``rope_theta``, else the model type's default. inv_freq is computed in
    float32, as transformers computes it: the float64 values, rounded once, differ by an ulp, and
    at long positions so do the angles."""
    params = config.get("rope_parameters")  # newer HF configs keep theta and the scaling together here
    legacy = config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise LayerConfigError(f"{where}: config.json {key} must be a JSON object or null, got {value!r}")
    rope = legacy or params or {}  # (a config with both: transformers keeps rope_scaling's alone)
    if any(isinstance(v, dict) for v in rope.values()):
        raise LayerConfigError(f"{where}: RoPE parameters per layer type ({', '.join(sorted(rope))}) are not "
                               "supported: one set for every layer")
    theta = rope.get("rope_theta", config.get("rope_theta"))
    theta = DEFAULT_THETA.get(model_type, 10000.0) if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0.0 < theta < math.inf:
        raise LayerConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    theta = float(theta)
    for partial in (config.get("partial_rotary_factor"), rope.get("partial_rotary_factor")):
        if partial is not None and (isinstance(partial, bool) or partial != 1):
            raise LayerConfigError(f"{where}: partial_rotary_factor {partial!r} is not supported: only full RoPE "
                                   "(the number 1)")
    if head_dim % 2:
        raise LayerConfigError(f"{where}: RoPE needs an even head_dim, got {head_dim}")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise LayerConfigError(
            f"{where}: rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / _scaling_number(rope, "factor", rope_type, where, at_least=1.0)
    elif rope_type == "llama3":
        low, high = (_scaling_number(rope, k, rope_type, where) for k in ("low_freq_factor", "high_freq_factor"))
        if not high > low:
            raise LayerConfigError(f"{where}: rope_scaling of type 'llama3' needs high_freq_factor > low_freq_factor, "
                                   f"got {high:g} and {low:g}")
        # the pretraining length: a top-level original_max_position_embeddings wins (Phi-3 saves it
        # there), then the scaling's own, then max_position_embeddings
        key = "original_max_position_embeddings"
        found = [v for v in (config.get(key), rope.get(key), config.get("max_position_embeddings")) if v is not None]
        length = {key: found[0]} if found else {}
        inv_freq = _llama3_inv_freq(inv_freq, _scaling_number(rope, "factor", rope_type, where, at_least=1.0),
                                    low, high, _scaling_number(length, key, rope_type, where))
    return Rope(inv_freq)


def _scaling_number(scaling: dict[str, Any], key: str, rope_type: str, where: str, at_least: float = 0.0) -> float:
    """A rope_scaling field: a finite number, at least ``at_least`` (else positive); a clear error otherwise
    (a factor of 0 gave all-NaN answers, a negative one a reversed rotation)."""
    if key not in scaling:
        raise LayerConfigError(f"{where}: rope_scaling of type {rope_type!r} lacks {key!r}")
    value = scaling[key]
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and (
        value >= at_least if at_least else value > 0)
    if not ok:
        bound = f"a number of at least {at_least:g}" if at_least else "a positive number"
        raise LayerConfigError(f"{where}: rope_scaling {key} must be {bound}, got {value!r}")
    return float(value)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low: float, high: float,
                     old_len: float) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
