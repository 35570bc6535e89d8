"""Model layers: one attention block of a real Hugging Face checkpoint, loaded at start-up.

    layers = load_layers(settings)          # {"minilm0": Layer, ...} from --layer NAME=DIR:INDEX
    dev = layers["minilm0"].to(torch.device("cuda:0"))
    y = dev.forward(x, causal=False, positions=None, kv_lengths=None)   # x, y: (B, N, hidden)

A layer computes ``y = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))`` with the checkpoint's
biases and GQA head counts, and rotary position embedding (RoPE) on q and k for the Llama family.
No residual, no norm.

Modules: ``layer`` (Layer, DeviceLayer, check_call: a loaded layer and the check of a call's
inputs), ``families`` (which config.json is which family, its tensor names, RoPE), ``checkpoint``
(specs, config.json and safetensors loading). The names below are what the rest of the code imports.
"""

from service.layers.checkpoint import (
    NAME_RE,
    PICKLE_SUFFIXES,
    TensorStore,
    load_layer,
    load_layers,
    parse_dtype,
    parse_layer_spec,
)
from service.layers.families import ARCH_PREFIX, FAMILY_OF, ROPE_TYPES, Rope
from service.layers.layer import DeviceLayer, Layer, LayerConfigError, LayerInfo, Weights, check_call

__all__ = [
    "ARCH_PREFIX",
    "FAMILY_OF",
    "NAME_RE",
    "PICKLE_SUFFIXES",
    "ROPE_TYPES",
    "DeviceLayer",
    "Layer",
    "LayerConfigError",
    "LayerInfo",
    "Rope",
    "TensorStore",
    "Weights",
    "check_call",
    "load_layer",
    "load_layers",
    "parse_dtype",
    "parse_layer_spec",
]
