"""Model layers: one attention block of a real Hugging Face checkpoint, loaded at start-up.

    layers = load_layers(settings)          # {"minilm0": Layer, ...} from --layer NAME=DIR:INDEX
    dev = layers["minilm0"].to(torch.device("cuda:0"))
    y = dev.forward(x, causal=False, positions=None, kv_lengths=None)   # x, y: (B, N, hidden)

A layer computes ``y = o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))`` with the checkpoint's
biases and GQA head counts, and rotary position embedding (RoPE) on q and k for the Llama family.
No residual, no norm. Only the asked layer's tensors are read (``safetensors.safe_open``,
memory-mapped); pickle checkpoints (``.bin``/``.pt``) are refused.

Families and the tensor names they read (a ``bert.``/``roberta.``/``model.``/``<model_type>.`` prefix
is optional):
    bert   encoder.layer.{i}.attention.self.{query,key,value}.{weight,bias}
           encoder.layer.{i}.attention.output.dense.{weight,bias}
    llama  layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias where present, as in Qwen2)
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

import kernels
from service.errors import InvalidInput, from_kernel_error
from service.wire.tensors import FLOAT_DTYPES

log = logging.getLogger("attnserve.layers")

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
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # goes into URLs (/layers/{name}) and OIP model names


class LayerConfigError(ValueError):
    """A layer cannot be loaded: the message names the spec, folder, file or tensor at fault."""


@dataclass(frozen=True)
class LayerInfo:
    name: str
    family: str  # "bert" | "llama"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


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


@dataclass(frozen=True)
class Weights:
    """One block's linear maps, (out, in) as in nn.Linear.

    q: (Hq·D, hidden), k/v: (Hkv·D, hidden), o: (hidden, Hq·D); biases (out,) or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None

    def to(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Weights:
        moved = {k: None if t is None else t.to(device=device, dtype=dtype) for k, t in vars(self).items()}
        return Weights(**moved)


class DeviceLayer:
    """A layer's weights on one device; ``forward`` is what a worker calls (no autograd)."""

    def __init__(self, info: LayerInfo, weights: Weights, rope: Rope | None, device: torch.device,
                 sliding_window: int | None = None):
        self.info = info
        self.device = device
        self.sliding_window = sliding_window
        self._w = weights
        self._rope = rope

    def forward(
        self,
        x: torch.Tensor,
        *,
        causal: bool = False,
        positions: torch.Tensor | None = None,
        kv_lengths: torch.Tensor | None = None,
        kernel: str = "auto",
    ) -> torch.Tensor:
        """x: (B, N, hidden) float -> y: (B, N, hidden) in the layer's dtype, on this device.

        positions: integer (B, N), default 0..N-1 in every row (feeds RoPE; the bert family has none).
        kv_lengths: integer (B,); keys at positions >= kv_lengths[b] are masked (padding).
        Raises ``errors.InvalidInput`` for inputs that do not fit the layer.
        """
        h, hkv, d = self.info.num_heads, self.info.num_kv_heads, self.info.head_dim
        check_call(self.info, self.sliding_window, x, positions, kv_lengths)
        x = x.to(device=self.device, dtype=self.info.dtype)
        b, n, _ = x.shape
        positions = self._check_positions(positions, b, n)
        kv_lengths = self._check_kv_lengths(kv_lengths, b)
        w = self._w
        with torch.no_grad():
            # (B, N, H·D) -> (B, N, H, D) -> (B, H, N, D)
            q = F.linear(x, w.q, w.q_bias).view(b, n, h, d).transpose(1, 2)
            k = F.linear(x, w.k, w.k_bias).view(b, n, hkv, d).transpose(1, 2)
            v = F.linear(x, w.v, w.v_bias).view(b, n, hkv, d).transpose(1, 2)
            if self._rope is not None:
                q, k = self._rope.apply(q, positions), self._rope.apply(k, positions)
            try:
                o = kernels.attention(q, k, v, causal=causal, kv_lengths=kv_lengths, kernel=kernel)
            except kernels.AttentionInputError as exc:
                raise from_kernel_error(exc) from None
            o = o.transpose(1, 2).reshape(b, n, h * d)  # (B, H, N, D) -> (B, N, H·D)
            return F.linear(o, w.o, w.o_bias)

    __call__ = forward

    def _check_positions(self, positions: Any, b: int, n: int) -> torch.Tensor | None:
        if positions is None:
            return None if self._rope is None else torch.arange(n, device=self.device).expand(b, n)
        return positions.to(device=self.device, dtype=torch.int64)

    def _check_kv_lengths(self, kv_lengths: Any, b: int) -> torch.Tensor | None:
        return None if kv_lengths is None else kv_lengths.to(self.device)


def check_call(info: LayerInfo, sliding_window: int | None, x: Any, positions: Any = None,
               kv_lengths: Any = None) -> None:
    """Raise ``errors.InvalidInput`` unless x (B, N, hidden) float, positions integer (B, N) and
    kv_lengths integer (B,) fit the layer. Cheap and host-side: the engine calls it before queueing
    a request, and ``DeviceLayer.forward`` before computing (kv_lengths' range only for host tensors:
    reading it on a GPU would synchronise the device)."""

    def invalid(message: str) -> InvalidInput:
        return InvalidInput(f"layer {info.name!r}: {message}")

    hidden = info.hidden_size
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden:
        raise invalid(f"x must have shape [B, N, {hidden}] (hidden size {hidden}), got {_shape(x)}")
    b, n = x.shape[0], x.shape[1]
    if b < 1 or n < 1:
        raise invalid(f"x needs B >= 1 and N >= 1, got {list(x.shape)}")
    if not x.is_floating_point():
        raise invalid(f"x must be a float tensor, got {x.dtype}")
    if sliding_window is not None and n > sliding_window:
        raise invalid(
            f"the checkpoint uses sliding-window attention over {sliding_window} tokens, which is not "
            f"implemented; sequences of up to {sliding_window} tokens are exact, got N={n}"
        )
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (b, n):
            raise invalid(f"positions must have shape [B, N] = [{b}, {n}], got {_shape(positions)}")
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise invalid(f"positions must be integers (int64), got {positions.dtype}")
    if kv_lengths is not None:
        if not isinstance(kv_lengths, torch.Tensor) or tuple(kv_lengths.shape) != (b,):
            raise invalid(f"kv_lengths must have shape [B] = [{b}], got {_shape(kv_lengths)}")
        if kv_lengths.dtype not in (torch.int32, torch.int64):
            raise invalid(f"kv_lengths must be int32 or int64, got {kv_lengths.dtype}")
        if kv_lengths.device.type == "cpu" and (int(kv_lengths.min()) < 0 or int(kv_lengths.max()) > n):
            raise invalid(f"kv_lengths must lie in [0, {n}] (N)")


def _shape(t: Any) -> Any:
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


class Layer:
    """A loaded layer, weights on the CPU in ``info.dtype``; ``to(device)`` gives what a worker runs."""

    def __init__(self, info: LayerInfo, weights: Weights, rope: Rope | None = None, *,
                 source: str = "", sliding_window: int | None = None):
        self.info = info
        self.source = source  # "DIR:INDEX", for logs
        self.sliding_window = sliding_window  # Mistral-style window: longer sequences are refused
        self._w = weights
        self._rope = rope

    def check_call(self, x: Any, positions: Any = None, kv_lengths: Any = None) -> None:
        """Validate a call's inputs on the host (``check_call``), before it is queued."""
        check_call(self.info, self.sliding_window, x, positions, kv_lengths)

    def to(self, device: torch.device | str) -> DeviceLayer:
        device = torch.device(device)
        rope = None if self._rope is None else self._rope.to(device)
        return DeviceLayer(self.info, self._w.to(device), rope, device, self.sliding_window)

    def __repr__(self) -> str:
        return f"Layer({self.info}, source={self.source!r})"


# ---------------------------------------------------------------- specs and settings


def parse_layer_spec(spec: str) -> tuple[str, Path, int]:
    """"NAME=DIR:INDEX" -> (name, Path(DIR), index). DIR may itself hold ':' (the last one splits)."""
    name, eq, rest = spec.partition("=")
    folder, colon, index = rest.rpartition(":")
    name, folder, index = name.strip(), folder.strip(), index.strip()
    if not (eq and colon and name and folder):
        raise LayerConfigError(
            f"layer spec {spec!r} must look like NAME=DIR:INDEX, e.g. minilm0=/models/all-MiniLM-L6-v2:0"
        )
    if not NAME_RE.match(name):
        raise LayerConfigError(
            f"layer spec {spec!r}: the name {name!r} may hold only letters, digits, '_', '.' and '-' "
            "(it goes into URLs and model names)"
        )
    if not index.isdigit():
        raise LayerConfigError(f"layer spec {spec!r}: INDEX must be a non-negative integer, got {index!r}")
    return name, Path(folder), int(index)


def parse_dtype(name: str | None) -> torch.dtype | None:
    """A --layer-dtype value -> torch dtype; None or "" -> None (the checkpoint's)."""
    if not name:
        return None
    if name not in FLOAT_DTYPES:
        raise LayerConfigError(f"layer dtype {name!r} is not supported; choose one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


def load_layers(settings) -> dict[str, Layer]:
    """Every ``settings.layer`` spec, loaded in order, in ``settings.layer_dtype`` (else the checkpoint's)."""
    dtype = parse_dtype(settings.layer_dtype)
    layers: dict[str, Layer] = {}
    for spec in settings.layer:
        name, folder, index = parse_layer_spec(spec)
        if name in layers:
            raise LayerConfigError(f"layer spec {spec!r}: the name {name!r} is given twice")
        layers[name] = load_layer(name, folder, index, dtype)
    return layers


# ---------------------------------------------------------------- loading


def load_layer(name: str, folder: str | Path, index: int, dtype: torch.dtype | str | None = None) -> Layer:
    """Read layer ``index`` of the checkpoint in ``folder`` (config.json + safetensors) onto the CPU.

    dtype: the weights' dtype (torch dtype or its name); None keeps the checkpoint's (float32 if the
    kernels do not take it). Raises ``LayerConfigError`` naming what is wrong.
    """
    folder = Path(folder)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    where = f"layer {name!r} ({folder}:{index})"
    if not folder.is_dir():
        raise LayerConfigError(f"{where}: checkpoint folder {folder} does not exist or is not a folder")
    config = _read_config(folder, where)
    model_type = _model_type(config, folder, where)
    family = FAMILY_OF[model_type]
    n_layers = config.get("num_hidden_layers")
    if index < 0 or (isinstance(n_layers, int) and index >= n_layers):
        raise LayerConfigError(
            f"{where}: layer index {index} is out of range; the checkpoint has num_hidden_layers={n_layers}"
        )
    store = TensorStore(folder, where)
    if family == "bert":
        info, weights, rope = _load_bert(name, config, model_type, index, store, where)
    else:
        info, weights, rope = _load_llama(name, config, model_type, index, store, where)
    dtype = _choose_dtype(weights.q.dtype, dtype)
    info = LayerInfo(**{**vars(info), "dtype": dtype})
    window = _sliding_window(config, model_type, index) if family == "llama" else None
    log.info("layer %s: %s (%s) layer %d of %s: %d heads (%d kv) of %d, %s", name, family, model_type, index,
             folder, info.num_heads, info.num_kv_heads, info.head_dim, dtype)
    return Layer(info, weights.to(dtype=dtype), rope, source=f"{folder}:{index}", sliding_window=window)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise LayerConfigError(f"{where}: {path} is missing; a Hugging Face checkpoint folder has one")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LayerConfigError(f"{where}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise LayerConfigError(f"{where}: {path} must hold a JSON object")
    return config


def _model_type(config: dict[str, Any], folder: Path, where: str) -> str:
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type is None and isinstance(archs, list):
        model_type = next((t for a in archs for p, t in ARCH_PREFIX.items() if str(a).startswith(p)), None)
    if model_type not in FAMILY_OF:
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


def _load_bert(name, config, model_type, index, store, where):
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


def _load_llama(name, config, model_type, index, store, where):
    hidden, heads, kv_heads, head_dim = _heads(config, where, llama=True)
    rope = _rope(config, head_dim, where)
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
    weights = Weights(**store.read(names, optional=("q_bias", "k_bias", "v_bias", "o_bias")))
    info = LayerInfo(name, "llama", hidden, heads, kv_heads, head_dim, weights.q.dtype)
    return info, weights, rope


def _choose_dtype(checkpoint: torch.dtype, configured: torch.dtype | None) -> torch.dtype:
    """The configured dtype, else the checkpoint's where the kernels take it, else float32."""
    if configured is not None:
        return configured
    return checkpoint if checkpoint in kernels.SUPPORTED_DTYPES else torch.float32


def _sliding_window(config: dict[str, Any], model_type: str, index: int) -> int | None:
    """This layer's attention window as HF computes it, or None for full attention."""
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and index < len(layer_types):
        active = layer_types[index] == "sliding_attention"
    elif model_type == "qwen2":
        active = bool(config.get("use_sliding_window")) and index >= int(config.get("max_window_layers") or 0)
    else:
        active = model_type in ("mistral", "mixtral")
    return int(window) if active else None


def _rope(config: dict[str, Any], head_dim: int, where: str) -> Rope:
    """inv_freq of HF's plain RoPE, and of its "linear" and "llama3" rope_scaling types."""
    params = config.get("rope_parameters")  # newer HF configs keep theta and the scaling together here
    scaling = params if isinstance(params, dict) else config.get("rope_scaling")
    theta = float((params or {}).get("rope_theta") or config.get("rope_theta") or 10000.0)
    partial = config.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise LayerConfigError(f"{where}: partial_rotary_factor={partial} is not supported (only full RoPE)")
    if head_dim % 2:
        raise LayerConfigError(f"{where}: RoPE needs an even head_dim, got {head_dim}")
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise LayerConfigError(
            f"{where}: rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    try:
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
    except KeyError as exc:
        raise LayerConfigError(f"{where}: rope_scaling of type {rope_type!r} lacks {exc.args[0]!r}") from None
    return Rope(inv_freq.to(torch.float32))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class TensorStore:
    """Tensor names -> safetensors files of one checkpoint folder; reads single tensors, not whole files."""

    INDEX = "model.safetensors.index.json"
    SINGLE = "model.safetensors"

    def __init__(self, folder: Path, where: str):
        self.folder, self.where = folder, where
        if (folder / self.INDEX).is_file():
            self.listing = self.INDEX
            try:
                self.files: dict[str, str] = dict(json.loads((folder / self.INDEX).read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise self._error(f"cannot read the weight_map of {folder / self.INDEX}: {exc!r}") from None
        elif (folder / self.SINGLE).is_file():
            self.listing = self.SINGLE
            with self._open(self.SINGLE) as f:
                self.files = dict.fromkeys(f.keys(), self.SINGLE)
        else:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise self._error(
                    f"{folder} holds only pickle weights ({', '.join(pickles)}), which are never loaded "
                    "(unpickling can run code); convert them to model.safetensors first"
                )
            raise self._error(f"{folder} has neither {self.SINGLE} nor {self.INDEX}")

    def has(self, name: str) -> bool:
        return name in self.files

    def prefix(self, name: str, candidates: tuple[str, ...]) -> str:
        """The first prefix under which ``name`` exists; a clear error when none does."""
        candidates = tuple(dict.fromkeys(candidates))
        found = next((p for p in candidates if p + name in self.files), None)
        if found is None:
            tried = ", ".join(repr(p + name) for p in candidates)
            raise self._error(f"missing tensor {name!r} in {self.folder / self.listing} (tried {tried})")
        return found

    def read(self, names: dict[str, tuple[str, tuple[int, ...]]], optional) -> dict[str, torch.Tensor | None]:
        """{key: (tensor name, expected shape)} -> {key: tensor}; a missing optional one reads as None."""
        out: dict[str, torch.Tensor | None] = {}
        by_file: dict[str, list[str]] = {}
        for key, (tname, _) in names.items():
            if tname in self.files:
                by_file.setdefault(self.files[tname], []).append(key)
            elif key in optional:
                out[key] = None
            else:
                raise self._error(f"missing tensor {tname!r} in {self.folder / self.listing}")
        for file, keys in by_file.items():
            path = self.folder / file
            with self._open(file) as f:
                present = set(f.keys())
                for key in keys:
                    tname, shape = names[key]
                    if tname not in present:
                        raise self._error(f"missing tensor {tname!r} in {path}")
                    t = f.get_tensor(tname)  # reads this tensor's bytes only (memory-mapped file)
                    if tuple(t.shape) != shape:
                        raise self._error(
                            f"tensor {tname!r} in {path} has shape {list(t.shape)}, "
                            f"but config.json implies {list(shape)}"
                        )
                    if not t.is_floating_point():
                        raise self._error(f"tensor {tname!r} in {path} has dtype {t.dtype}, not a float")
                    out[key] = t
        return out

    def _open(self, file: str):
        if Path(file).name != file or not file.endswith(".safetensors"):
            raise self._error(f"refusing weight file {file!r}: not a .safetensors file inside {self.folder}")
        path = self.folder / file
        if not path.is_file():
            raise self._error(f"weight file {path} (named in {self.listing}) is missing")
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
            raise self._error(f"cannot open {path}: {exc}") from None

    def _error(self, message: str) -> LayerConfigError:
        return LayerConfigError(f"{self.where}: {message}")
