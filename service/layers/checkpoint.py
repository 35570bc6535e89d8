"""Loading: ``--layer NAME=DIR:INDEX`` specs, and one layer of a Hugging Face checkpoint folder
(config.json + safetensors), read onto the CPU. Only the asked layer's tensors are read
(``safetensors.safe_open``, memory-mapped); pickle checkpoints (``.bin``/``.pt``) are refused.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import kernels
from service.layers.families import FAMILY_OF, load_bert, load_llama, model_type_of, sliding_window
from service.layers.layer import Layer, LayerConfigError, LayerInfo
from service.wire.tensors import FLOAT_DTYPES

log = logging.getLogger("attnserve.layers")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # goes into URLs (/layers/{name}) and OIP model names


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
    if not (index.isascii() and index.isdigit()):
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
    from service.wire import oip
    dtype = parse_dtype(settings.layer_dtype)
    layers: dict[str, Layer] = {}
    for spec in settings.layer:
        name, folder, index = parse_layer_spec(spec)
        if name in layers:
            raise LayerConfigError(f"layer spec {spec!r}: the name {name!r} is given twice")
        if name == oip.ATTENTION:  # an OIP model of its own name: that one is the attention's
            raise LayerConfigError(f"layer spec {spec!r}: the name {name!r} is the Open Inference Protocol's "
                                   "attention model; name the layer otherwise")
        layers[name] = load_layer(name, folder, index, dtype)
    return layers


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
    model_type = model_type_of(config, folder, where)
    family = FAMILY_OF[model_type]
    n_layers = config.get("num_hidden_layers")
    if index < 0 or (isinstance(n_layers, int) and index >= n_layers):
        raise LayerConfigError(
            f"{where}: layer index {index} is out of range; the checkpoint has num_hidden_layers={n_layers}"
        )
    store = TensorStore(folder, where)
    if family == "bert":
        info, weights, rope = load_bert(name, config, model_type, index, store, where)
    else:
        info, weights, rope = load_llama(name, config, model_type, index, store, where)
    dtype = _choose_dtype(weights.q.dtype, dtype)
    info = LayerInfo(**{**vars(info), "dtype": dtype})
    window = sliding_window(config, model_type, index, where) if family == "llama" else None
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


def _choose_dtype(checkpoint: torch.dtype, configured: torch.dtype | None) -> torch.dtype:
    """The configured dtype, else the checkpoint's where the kernels take it, else float32."""
    if configured is not None:
        return configured
    return checkpoint if checkpoint in kernels.SUPPORTED_DTYPES else torch.float32



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
            bad = next((k for k, v in self.files.items() if not isinstance(v, str)), None)
            if bad is not None:
                raise self._error(f"the weight_map of {folder / self.INDEX} names {self.files[bad]!r} as the file "
                                  f"of {bad!r}: a file name (a string) is expected")
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
                    if t.dtype not in WEIGHT_DTYPES:  # float8 weights need their scales (quantized): not read
                        raise self._error(f"tensor {tname!r} in {path} has dtype {t.dtype}; the weights must be "
                                          "float16, bfloat16, float32 or float64 (a quantized checkpoint is not "
                                          "served: use its unquantized release)")
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
