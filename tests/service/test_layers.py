"""service/layers.py: loading one attention block of a HF checkpoint, and computing it.

Numerics are checked against ``reference_block`` below: plain matmuls, an explicit softmax and RoPE
written as a rotation of (x_j, x_{j+D/2}) pairs, in float64 on the same weights. The layer's error
must stay within ~2x that of the same computation in plain PyTorch at the layer's dtype (STYLE 11).
Where ``transformers`` is installed, the layer is also checked against its attention modules.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from layer_fixtures import block, write_bert, write_llama
from safetensors.torch import load_file, save_file

import kernels
from service import layers as layers_mod
from service.errors import InvalidInput
from service.layers import LayerConfigError, LayerInfo, load_layer, load_layers, parse_layer_spec
from service.settings import Settings

# Lengths: 1 (one token), 7 (under any block), 33 (one past a block of 32).
LENGTHS = [1, 7, 33]

# (case id, write_llama kwargs): head layouts of real families.
LLAMA_CASES = [
    ("gqa-8-2", dict(num_heads=8, num_kv_heads=2)),  # Llama-3 style grouping
    ("mha", dict(num_heads=4, num_kv_heads=4, prefix="")),  # no "model." prefix, Hkv = Hq
    ("mqa-headdim", dict(num_heads=4, num_kv_heads=1, head_dim=24)),  # config head_dim != hidden/heads
    ("qwen2-bias-sharded", dict(model_type="qwen2", bias=True, num_heads=8, num_kv_heads=2, shards=3,
                                rope_theta=1e6)),  # q/k/v biases, 3 shard files
]

# (case id, write_bert kwargs)
BERT_CASES = [
    ("bert-prefixed", dict(prefix="bert.")),
    ("minilm-no-prefix", dict(prefix="", hidden_size=48, num_heads=12)),  # all-MiniLM-L6-v2's names
    ("roberta-sharded", dict(prefix="roberta.", model_type="roberta", shards=2)),
]


# conftest turns the Triton interpreter on for the whole run on a machine without CUDA
INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def cpu_paths(monkeypatch):
    """On the CPU, "auto" runs the blockwise path (not the Triton interpreter, which is slow)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# ---------------------------------------------------------------- the independent reference


def inv_freq_of(theta: float, head_dim: int) -> torch.Tensor:
    return torch.tensor([theta ** (-2 * j / head_dim) for j in range(head_dim // 2)], dtype=torch.float64)


def rotate_pairs(t: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """t: (B, H, N, D); rotate each pair (t_j, t_{j+D/2}) by angle positions * inv_freq[j]."""
    angle = positions.to(torch.float64)[:, None, :, None] * inv_freq  # (B, 1, N, D/2)
    cos, sin = angle.cos().to(t.dtype), angle.sin().to(t.dtype)
    half = t.shape[-1] // 2
    a, b = t[..., :half], t[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def reference_block(w, x, *, heads, kv_heads, head_dim, inv_freq=None, positions=None, causal=False,
                    kv_lengths=None, sliding_window=None, dtype=torch.float64) -> torch.Tensor:
    """y = o(softmax(q kᵀ/√D + mask) v) written out: x (B, N, hidden) -> (B, N, hidden) in ``dtype``;
    ``sliding_window`` W: query i sees keys i - W < j (HF's sliding_window_overlay)."""
    w = {k: None if t is None else t.to(dtype) for k, t in w.items()}
    x = x.to(dtype)
    bsz, n, _ = x.shape

    def proj(key, h):
        out = x @ w[key].T + (0 if w[key + "_bias"] is None else w[key + "_bias"])
        return out.reshape(bsz, n, h, head_dim).permute(0, 2, 1, 3)  # (B, h, N, D)

    q, k, v = proj("q", heads), proj("k", kv_heads), proj("v", kv_heads)
    if inv_freq is not None:
        pos = positions if positions is not None else torch.arange(n).expand(bsz, n)
        q, k = rotate_pairs(q, pos, inv_freq), rotate_pairs(k, pos, inv_freq)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(head_dim)  # (B, H, N, N)
    visible = torch.ones(bsz, 1, n, n, dtype=torch.bool)
    if causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    if sliding_window is not None:
        visible &= torch.arange(n)[None, :] > torch.arange(n)[:, None] - sliding_window
    if kv_lengths is not None:
        visible &= (torch.arange(n)[None, :] < kv_lengths[:, None])[:, None, None, :]
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(dtype).min)  # an all-masked row has max -inf
    p = torch.exp(s - m).masked_fill(~visible, 0.0)
    denom = p.sum(-1, keepdim=True)
    o = (p @ v) / torch.where(denom == 0, torch.ones_like(denom), denom)  # all-masked rows -> 0
    o = o.permute(0, 2, 1, 3).reshape(bsz, n, heads * head_dim)
    return o @ w["o"].T + (0 if w["o_bias"] is None else w["o_bias"])


def assert_within_budget(y: torch.Tensor, ref64: torch.Tensor, plain: torch.Tensor) -> None:
    """|y - ref| <= 2 |plain - ref| + a hair, with ``plain`` the same math in PyTorch at y's dtype."""
    err = (y.double() - ref64).abs().max().item()
    budget = 2 * (plain.double() - ref64).abs().max().item() + 1e-6 * ref64.abs().max().item()
    assert err <= budget, f"max error {err:.3g} over budget {budget:.3g}"


def check(dev, weights, x, *, inv_freq=None, kernel="reference", **opts):
    """Run the layer and compare with the float64 reference and the plain-PyTorch budget."""
    info = dev.info
    shape = dict(heads=info.num_heads, kv_heads=info.num_kv_heads, head_dim=info.head_dim, inv_freq=inv_freq,
                 sliding_window=dev.sliding_window)
    y = dev.forward(x, kernel=kernel, **opts)
    assert y.shape == x.shape and y.dtype == info.dtype
    ref = reference_block(weights, x, **shape, **opts)
    plain = reference_block(weights, x.to(info.dtype), **shape, **opts, dtype=info.dtype)
    assert_within_budget(y, ref, plain)
    return y


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("case", [c for _, c in BERT_CASES], ids=[i for i, _ in BERT_CASES])
@pytest.mark.parametrize("n", LENGTHS)
def test_bert_matches_float64(tmp_path, case, n):
    tensors = write_bert(tmp_path / "ckpt", **case)
    layer = load_layer("enc", tmp_path / "ckpt", 1)
    hidden = case.get("hidden_size", 40)
    assert layer.info == LayerInfo("enc", "bert", hidden, case.get("num_heads", 5), case.get("num_heads", 5),
                                   hidden // case.get("num_heads", 5), torch.float32)
    dev = layer.to(torch.device("cpu"))
    x = torch.randn(2, n, hidden, generator=torch.Generator().manual_seed(n))
    w = block(tensors, 1)
    check(dev, w, x)
    check(dev, w, x, kv_lengths=torch.tensor([n, max(n // 2, 1)], dtype=torch.int32), kernel="auto")


@pytest.mark.parametrize("case", [c for _, c in LLAMA_CASES], ids=[i for i, _ in LLAMA_CASES])
@pytest.mark.parametrize("n", LENGTHS)
def test_llama_matches_float64(tmp_path, case, n):
    tensors = write_llama(tmp_path / "ckpt", **case)
    layer = load_layer("dec", tmp_path / "ckpt", 1)
    heads, kv_heads = case["num_heads"], case["num_kv_heads"]
    head_dim = case.get("head_dim") or 64 // heads
    assert layer.info == LayerInfo("dec", "llama", 64, heads, kv_heads, head_dim, torch.float32)
    dev = layer.to("cpu")
    inv_freq = inv_freq_of(case.get("rope_theta", 10000.0), head_dim)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, 64, generator=gen)
    w = block(tensors, 1)
    check(dev, w, x, inv_freq=inv_freq, causal=True)
    # positions with an offset and gaps (a continued sequence, packed rows); non-causal; padded keys
    positions = torch.stack([torch.arange(n) + 5, torch.arange(n) * 3 + 100])
    check(dev, w, x, inv_freq=inv_freq, positions=positions, kernel="auto",
          kv_lengths=torch.tensor([n, (n + 1) // 2], dtype=torch.int64))


@pytest.mark.parametrize(("ckpt_dtype", "configured", "expect"), [
    (torch.bfloat16, None, torch.bfloat16),  # the checkpoint's dtype by default
    (torch.bfloat16, "float32", torch.float32),  # --layer-dtype float32 upcasts
    (torch.float32, "float16", torch.float16),  # --layer-dtype float16 downcasts
])
def test_dtypes(tmp_path, ckpt_dtype, configured, expect):
    tensors = write_llama(tmp_path / "ckpt", dtype=ckpt_dtype, model_type="qwen2", bias=True)
    dev = load_layer("l", tmp_path / "ckpt", 0, configured).to("cpu")
    assert dev.info.dtype == expect
    x = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(0))  # float32 in: converted
    y = check(dev, block(tensors, 0), x, inv_freq=inv_freq_of(10000.0, 8), causal=True)
    assert y.dtype == expect


def test_linear_rope_scaling(tmp_path):
    tensors = write_llama(tmp_path / "ckpt", rope_scaling={"rope_type": "linear", "factor": 4.0})
    dev = load_layer("l", tmp_path / "ckpt", 0).to("cpu")
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)[None] * 7
    check(dev, block(tensors, 0), x, inv_freq=inv_freq_of(10000.0, 8) / 4.0, positions=positions)


def test_all_keys_masked_gives_bias_only(tmp_path):
    """kv_lengths 0: the row sees no key, attention gives 0, so y is o_proj's bias (never NaN)."""
    tensors = write_bert(tmp_path / "ckpt")
    dev = load_layer("b", tmp_path / "ckpt", 0).to("cpu")
    y = dev.forward(torch.randn(2, 5, 40), kv_lengths=torch.tensor([0, 5]))
    o_bias = tensors["bert.encoder.layer.0.attention.output.dense.bias"]
    torch.testing.assert_close(y[0], o_bias.expand(5, 40))
    assert not y.isnan().any()


@pytest.mark.parametrize("causal", [False, True])
def test_batched_rows_equal_each_alone(tmp_path, causal):
    """A padded batch (kv_lengths) gives, on each row's real tokens, what that row alone gives."""
    write_llama(tmp_path / "ckpt", num_heads=8, num_kv_heads=2)
    dev = load_layer("l", tmp_path / "ckpt", 0).to("cpu")
    lengths = [7, 1, 4]
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    y = dev.forward(x, causal=causal, kv_lengths=torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone = dev.forward(x[i : i + 1, :n], causal=causal)
        torch.testing.assert_close(y[i, :n], alone[0], rtol=1e-5, atol=1e-5)


def test_gqa_goes_to_the_kernel_unrepeated(tmp_path, monkeypatch):
    """q (B, Hq, N, D) and k/v (B, Hkv, N, D) reach kernels.attention as-is, with the asked kernel."""
    write_llama(tmp_path / "ckpt", num_heads=8, num_kv_heads=2)
    dev = load_layer("l", tmp_path / "ckpt", 0).to("cpu")
    seen = {}
    real = kernels.attention

    def spy(q, k, v, **kw):
        seen.update(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), **kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(kernels, "attention", spy)
    dev.forward(torch.randn(2, 5, 64), causal=True, kernel="reference")
    assert seen["q"] == (2, 8, 5, 8) and seen["k"] == seen["v"] == (2, 2, 5, 8)
    assert seen["kernel"] == "reference" and seen["causal"] is True


def test_flash_kernel_through_interpreter(tmp_path, monkeypatch):
    """The Triton kernel reads the layer's transposed (B, H, N, D) views (one small shape)."""
    if INTERPRET_AT_START in ("", "0"):
        pytest.skip("the Triton interpreter is off in this run (test_on_cuda runs the kernel on a GPU)")
    monkeypatch.setenv("TRITON_INTERPRET", INTERPRET_AT_START)  # before triton is first imported
    pytest.importorskip("triton")
    tensors = write_llama(tmp_path / "ckpt", num_heads=4, num_kv_heads=2)
    dev = load_layer("l", tmp_path / "ckpt", 0).to("cpu")
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    check(dev, block(tensors, 0), x, inv_freq=inv_freq_of(10000.0, 16), causal=True, kernel="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_on_cuda(tmp_path, dtype):
    tensors = write_llama(tmp_path / "ckpt", model_type="qwen2", bias=True, shards=2)
    dev = load_layer("l", tmp_path / "ckpt", 1, dtype).to(torch.device("cuda"))
    x = torch.randn(2, 97, 64, generator=torch.Generator().manual_seed(0))
    y = dev.forward(x.cuda(), causal=True, kv_lengths=torch.tensor([97, 50], device="cuda"))
    assert y.device.type == "cuda"
    opts = dict(heads=8, kv_heads=2, head_dim=8, inv_freq=inv_freq_of(10000.0, 8), causal=True,
                kv_lengths=torch.tensor([97, 50]))
    w = block(tensors, 1)
    ref = reference_block(w, x, **opts)
    plain = reference_block(w, x.to(dev.info.dtype), **opts, dtype=dev.info.dtype)
    assert_within_budget(y.cpu(), ref, plain)


# ---------------------------------------------------------------- loading


def test_reads_only_the_asked_layer(tmp_path, monkeypatch):
    write_llama(tmp_path / "ckpt", num_layers=3, shards=2)
    read: list[str] = []
    from service.layers import checkpoint

    real_open = checkpoint.safe_open

    class Recorder:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", Recorder)
    load_layer("l", tmp_path / "ckpt", 2)
    assert read and all(n.startswith("model.layers.2.self_attn.") for n in read), read


def test_config_without_model_type_uses_architectures(tmp_path):
    write_bert(tmp_path / "ckpt", prefix="")
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    del config["model_type"]
    (tmp_path / "ckpt/config.json").write_text(json.dumps(config))
    assert load_layer("b", tmp_path / "ckpt", 0).info.family == "bert"
    for arch in ("Llama4ForCausalLM", "Qwen2MoeForCausalLM", "BertGenerationEncoder"):  # names that extend one
        (tmp_path / "ckpt/config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        with pytest.raises(LayerConfigError, match="unknown model family"):
            load_layer("b", tmp_path / "ckpt", 0)


def test_load_layers_from_settings(tmp_path):
    write_bert(tmp_path / "minilm", prefix="")
    write_llama(tmp_path / "llama", shards=2)
    specs = [f"enc0={tmp_path}/minilm:0", f"dec1={tmp_path}/llama:1"]
    settings = Settings(layer=specs, layer_dtype="bfloat16")
    loaded = load_layers(settings)
    assert list(loaded) == ["enc0", "dec1"]
    assert [(lay.info.family, lay.info.dtype) for lay in loaded.values()] == [
        ("bert", torch.bfloat16), ("llama", torch.bfloat16)]
    assert load_layers(Settings()) == {}


@pytest.mark.parametrize(("spec", "expect"), [
    ("minilm0=/models/all-MiniLM-L6-v2:0", ("minilm0", "/models/all-MiniLM-L6-v2", 0)),
    ("q.v-2=C:/m/x:11", ("q.v-2", "C:/m/x", 11)),  # the last ':' splits off the index
])
def test_parse_layer_spec(spec, expect):
    name, folder, index = parse_layer_spec(spec)
    assert (name, str(folder), index) == expect


@pytest.mark.parametrize("spec", [
    "minilm0", "minilm0=/models/m", "=/models/m:0", "a=:0", "a=/models/m:x", "a=/models/m:-1",
    "a b=/models/m:0", "a/b=/models/m:0",
])
def test_parse_layer_spec_errors(spec):
    with pytest.raises(LayerConfigError, match="layer spec") as exc:
        parse_layer_spec(spec)
    assert repr(spec) in str(exc.value)


def _edit(folder, edit) -> None:
    """One edit of a checkpoint folder: ("config", {changes}), ("drop" | "add", file, tensor name),
    ("retype", file, tensor name, dtype), ("index", tensor name, weight_map value), ("unlink", file),
    ("rename", file, new name) or ("write", file, text)."""
    op, *args = edit
    if op == "config":
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **args[0]}))
        return
    path = folder / args[0]
    if op in ("drop", "add"):
        tensors = load_file(str(path))
        if op == "drop":
            del tensors[args[1]]
        else:
            tensors[args[1]] = torch.ones(8)
        save_file(tensors, str(path), metadata={"format": "pt"})
    elif op == "retype":  # a tensor stored in another dtype (a quantized checkpoint's float8)
        tensors = load_file(str(path))
        tensors[args[1]] = tensors[args[1]].to(args[2])
        save_file(tensors, str(path), metadata={"format": "pt"})
    elif op == "index":  # the index's weight_map entry of a tensor set to a value
        index = folder / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        doc["weight_map"][args[0]] = args[1]
        index.write_text(json.dumps(doc))
    elif op == "unlink":
        path.unlink()
    elif op == "rename":
        path.rename(folder / args[1])
    else:
        path.write_text(args[1])


K_PROJ0 = "model.layers.0.self_attn.k_proj.weight"
V_BIAS0 = "bert.encoder.layer.0.attention.self.value.bias"

# (case id, family, writer kwargs, edit or None, layer index, what the message must say)
BROKEN = [
    ("missing-folder", None, {}, None, 0, r"nowhere does not exist"),
    ("missing-config", "bert", {}, ("unlink", "config.json"), 0, r"config\.json is missing"),
    ("bad-config-json", "bert", {}, ("write", "config.json", "{"), 0, r"cannot read .*config\.json"),
    ("unknown-family", "bert", {}, ("config", {"model_type": "gpt2", "architectures": ["GPT2Model"]}), 0,
     r"unknown model family \(model_type='gpt2'"),
    ("index-out-of-range", "llama", {}, None, 2, r"layer index 2 is out of range.*num_hidden_layers=2"),
    ("missing-tensor", "llama", {}, ("drop", "model.safetensors", K_PROJ0), 0,
     r"missing tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' in .*/model\.safetensors$"),
    ("missing-bert-bias", "bert", {}, ("drop", "model.safetensors", V_BIAS0), 0,
     r"missing tensor 'bert\.encoder\.layer\.0\.attention\.self\.value\.bias'"),
    ("no-layer-under-any-prefix", "bert", {}, ("config", {"model_type": "llama"}), 0,
     r"missing tensor 'layers\.0\.self_attn\.q_proj\.weight' .*\(tried"),
    ("missing-shard-file", "llama", {"shards": 2}, ("unlink", "model-00002-of-00002.safetensors"), 0,
     r"model-00002-of-00002\.safetensors \(named in model\.safetensors\.index\.json\) is missing"),
    ("shape-vs-config", "llama", {}, ("config", {"num_key_value_heads": 4}), 0,
     r"k_proj\.weight' in .* has shape \[16, 64\], but config\.json implies \[32, 64\]"),
    ("heads-not-divisible", "bert", {}, ("config", {"num_attention_heads": 3}), 0,
     r"hidden_size=40 is not divisible by num_attention_heads=3"),
    ("attention-bias-string", "llama", {}, ("config", {"attention_bias": "no"}), 0,
     r"attention_bias must be true or false, got 'no'"),
    ("kv-heads-not-divisor", "llama", {}, ("config", {"num_key_value_heads": 3}), 0,
     r"not a multiple of num_key_value_heads=3"),
    ("pickle-only", "bert", {}, ("rename", "model.safetensors", "pytorch_model.bin"), 0,
     r"only pickle weights \(pytorch_model\.bin\)"),
    ("no-weights", "bert", {}, ("unlink", "model.safetensors"), 0, r"neither model\.safetensors"),
    ("relative-position-bert", "bert", {}, ("config", {"position_embedding_type": "relative_key"}), 0,
     r"position_embedding_type='relative_key'"),
    ("rope-yarn", "llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, 0,
     r"rope_scaling type 'yarn' is not supported"),
    ("rope-dynamic-old-key", "llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, None, 0,
     r"rope_scaling type 'dynamic'"),
    ("rope-linear-no-factor", "llama", {"rope_scaling": {"rope_type": "linear"}}, None, 0, r"lacks 'factor'"),
    ("partial-rotary", "llama", {"config_extra": {"partial_rotary_factor": 0.5}}, None, 0,
     r"partial_rotary_factor 0\.5 is not supported"),
    ("qwen3-qk-norm", "llama", {}, ("add", "model.safetensors", "model.layers.0.self_attn.q_norm.weight"), 0,
     r"q_norm/k_norm"),
    # each once a traceback after the ports were bound, a message naming nothing, all-NaN answers, or 10000
    ("negative-window", "llama", {"config_extra": {"model_type": "mistral", "sliding_window": -4}}, None, 0,
     r"sliding_window must be a positive integer or null, got -4"),
    ("text-window", "llama", {"config_extra": {"model_type": "mistral", "sliding_window": "abc"}}, None, 0,
     r"sliding_window must be a positive integer or null, got 'abc'"),
    ("negative-rope-theta", "llama", {"config_extra": {"rope_theta": -1}}, None, 0,
     r"rope_theta must be a positive number, got -1"),
    ("zero-rope-theta", "llama", {"config_extra": {"rope_theta": 0}}, None, 0,
     r"rope_theta must be a positive number, got 0"),
    # a third outside battery: each was all-NaN answers, a reversed rotation, garbage, or a traceback
    ("rope-linear-factor-0", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 0}}, None, 0,
     r"rope_scaling factor must be a number of at least 1, got 0"),
    ("rope-linear-factor-negative", "llama", {"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, None, 0,
     r"factor must be a number of at least 1, got -2\.0"),
    ("rope-linear-factor-null", "llama", {"rope_scaling": {"rope_type": "linear", "factor": None}}, None, 0,
     r"factor must be a number of at least 1, got None"),
    ("rope-llama3-text-field", "llama",
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "abc", "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, None, 0,
     r"low_freq_factor must be a positive number, got 'abc'"),
    ("rope-scaling-a-string", "llama", {"config_extra": {"rope_scaling": "linear"}}, None, 0,
     r"rope_scaling must be a JSON object or null, got 'linear'"),
    ("rope-parameters-a-list", "llama", {"config_extra": {"rope_parameters": [1, 2]}}, None, 0,
     r"rope_parameters must be a JSON object or null"),
    ("partial-rotary-in-rope-parameters", "llama",
     {"config_extra": {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}}}, None, 0,
     r"partial_rotary_factor 0\.5"),
    ("model-type-a-list", "bert", {}, ("config", {"model_type": ["bert"]}), 0, r"unknown model family"),
    ("fp8-weights", "llama", {}, ("retype", "model.safetensors", K_PROJ0, torch.float8_e4m3fn), 0,
     r"k_proj\.weight' .* has dtype torch\.float8_e4m3fn; .*quantized checkpoint is not served"),
    ("index-names-no-file", "llama", {"shards": 2}, ("index", K_PROJ0, 5), 0,
     r"names 5 as the file of 'model\.layers\.0\.self_attn\.k_proj\.weight'"),
    # a bias transformers' module has, missing from the checkpoint (it once served without it)
    ("missing-qwen2-bias", "llama", {"model_type": "qwen2", "bias": True},
     ("drop", "model.safetensors", "model.layers.0.self_attn.q_proj.bias"), 0,
     r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
    ("missing-llama-o-bias", "llama", {"bias": True, "config_extra": {"attention_bias": True}}, None, 0,
     r"missing tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"),
    ("rope-per-layer-type", "llama", {"config_extra": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}}, None, 0,
     r"RoPE parameters per layer type \(full_attention\) are not supported"),
]


@pytest.mark.parametrize(("family", "kwargs", "edit", "index", "message"), [c[1:] for c in BROKEN],
                         ids=[c[0] for c in BROKEN])
def test_load_errors(tmp_path, family, kwargs, edit, index, message):
    folder = tmp_path / ("ckpt" if family else "nowhere")
    if family:
        {"bert": write_bert, "llama": write_llama}[family](folder, **kwargs)
    if edit:
        _edit(folder, edit)
    with pytest.raises(LayerConfigError, match=message) as exc:
        load_layer("broken", folder, index)
    assert str(exc.value).startswith(f"layer 'broken' ({folder}:{index}): ")


def test_settings_errors(tmp_path):
    write_bert(tmp_path / "ckpt")
    # an OIP model of that name is the attention's: the layer could not be reached (tritonclient got 400s)
    with pytest.raises(LayerConfigError, match="the name 'attention' is the Open Inference Protocol's"):
        load_layers(Settings(layer=[f"attention={tmp_path}/ckpt:0"]))
    with pytest.raises(ValueError, match="'float64' is not a layer dtype"):  # refused with the settings
        Settings(layer=[f"a={tmp_path}/ckpt:0"], layer_dtype="float64")
    with pytest.raises(LayerConfigError, match="'a' is given twice"):
        load_layers(Settings(layer=[f"a={tmp_path}/ckpt:0", f"a={tmp_path}/ckpt:1"]))
    with pytest.raises(LayerConfigError, match="NAME=DIR:INDEX"):
        load_layers(Settings(layer=["a"]))


# ---------------------------------------------------------------- request validation


@pytest.fixture
def llama_dev(tmp_path):
    write_llama(tmp_path / "ckpt", config_extra={"model_type": "mistral", "sliding_window": 16,
                                                  "architectures": ["MistralForCausalLM"]})
    return load_layer("mistral0", tmp_path / "ckpt", 0).to("cpu")


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(x=torch.randn(4, 64)), r"x must have shape \[B, N, 64\] \(hidden size 64\), got \[4, 64\]"),
    (dict(x=torch.randn(1, 4, 32)), r"hidden size 64\), got \[1, 4, 32\]"),
    (dict(x=torch.zeros(1, 0, 64)), r"N >= 1"),
    (dict(x=torch.ones(1, 4, 64, dtype=torch.int64)), r"float tensor"),
    (dict(positions=torch.arange(4)), r"positions must have shape \[B, N\] = \[2, 4\], got \[4\]"),
    (dict(positions=torch.zeros(2, 4)), r"positions must be integers"),
    (dict(kv_lengths=torch.tensor([4])), r"kv_lengths must have shape \[B\] = \[2\]"),
    (dict(kv_lengths=torch.tensor([4.0, 4.0])), r"kv_lengths must be int32 or int64"),
    (dict(kv_lengths=torch.tensor([5, 4])), r"kv_lengths must lie in \[0, 4\]"),  # the kernel's own check
    (dict(x=torch.randn(1, 17, 64)), r"causal sliding-window attention over 16 tokens.*N=17.*causal=true"),
])
def test_invalid_requests(llama_dev, kwargs, message):
    kwargs = {"x": torch.randn(2, 4, 64), **kwargs}
    with pytest.raises(InvalidInput, match=message):
        llama_dev.forward(kwargs.pop("x"), **kwargs)


def test_sliding_window_up_to_window_is_served(llama_dev):
    assert llama_dev.sliding_window == 16
    assert llama_dev.forward(torch.randn(1, 16, 64), causal=True).shape == (1, 16, 64)
    assert llama_dev.forward(torch.randn(1, 16, 64), causal=False).shape == (1, 16, 64)


def _mistral(tmp_path, window=16):
    tensors = write_llama(tmp_path / "ckpt", config_extra={"model_type": "mistral", "sliding_window": window,
                                                            "architectures": ["MistralForCausalLM"]})
    return tensors, load_layer("mistral0", tmp_path / "ckpt", 0)


def test_a_window_shorter_than_the_warm_up_call_still_starts(tmp_path):
    """The worker warms each layer with a 16-token call, causal and not; a non-causal call longer
    than a sliding window is refused, so a checkpoint whose window is under 16 once kept the
    server from starting. Its non-causal warm-up call is now the window's length."""
    import asyncio

    from service.core.engine import Engine
    from service.core.types import LayerRequest
    from service.settings import load_settings

    tensors, layer = _mistral(tmp_path, window=4)

    async def main():
        engine = Engine(load_settings(["--device", "cpu", "--warmup-shapes", "1x1x8x8",
                                       "--layer", f"mis={tmp_path / 'ckpt'}:0"]))
        await engine.start()
        try:
            assert engine.ready
            x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4))
            return x, (await engine.call_layer(LayerRequest("mis", x, causal=True))).y
        finally:
            await engine.drain()

    x, y = asyncio.run(main())
    torch.testing.assert_close(y, layer.to("cpu").forward(x, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["reference", "auto"])
@pytest.mark.parametrize("n", [16, 17, 40])
def test_sliding_window_longer_than_the_window_matches_float64(tmp_path, n, kernel):
    """N > W, causal: a query sees itself and the W - 1 keys before it (window_size (W - 1, 0))."""
    tensors, layer = _mistral(tmp_path)
    dev = layer.to("cpu")
    assert layers_mod.layer.window_of(16, True) == (15, -1)
    x = torch.randn(2, n, 64, generator=torch.Generator().manual_seed(n))
    check(dev, block(tensors, 0), x, inv_freq=inv_freq_of(10000.0, 8), causal=True, kernel=kernel)
    lengths = torch.tensor([n, n - 3], dtype=torch.int32)
    check(dev, block(tensors, 0), x, inv_freq=inv_freq_of(10000.0, 8), causal=True, kernel=kernel,
          kv_lengths=lengths)


# ---------------------------------------------------------------- against transformers' own modules


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


def _hf_model(hf, folder, cls_name):
    model, info = getattr(hf, cls_name).from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float64, attn_implementation="eager")
    assert not info["missing_keys"], f"fixture layout differs from {cls_name}'s: {info['missing_keys']}"
    return model.eval()


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_bert_matches_transformers(tmp_path, hf, prefix):
    write_bert(tmp_path / "ckpt", prefix=prefix, hidden_size=48, num_heads=12)
    model = _hf_model(hf, tmp_path / "ckpt", "BertModel")
    dev = load_layer("enc", tmp_path / "ckpt", 1).to("cpu")
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lengths = torch.tensor([9, 6])
    pad = torch.zeros(2, 1, 1, 9, dtype=torch.float64)
    pad.masked_fill_(torch.arange(9)[None, None, None, :] >= lengths[:, None, None, None], float("-inf"))
    attn = model.encoder.layer[1].attention
    with torch.no_grad():
        ref = attn.output.dense(attn.self(x, attention_mask=pad)[0])
    y = dev.forward(x, kv_lengths=lengths)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # short, so positions up to 130 reach every band
LLAMA_HF_CASES = [
    ("llama-gqa", "LlamaForCausalLM", dict(num_heads=8, num_kv_heads=2)),
    ("llama-headdim", "LlamaForCausalLM", dict(num_heads=4, num_kv_heads=2, head_dim=24, rope_theta=5e5)),
    ("qwen2-bias", "Qwen2ForCausalLM", dict(model_type="qwen2", bias=True, num_heads=8, num_kv_heads=2)),
    ("llama3-rope", "LlamaForCausalLM", dict(num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=5e5,
                                             rope_scaling=LLAMA3_SCALING)),
    ("linear-rope", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # bias tensors transformers' module has no bias for: left unread, as transformers leaves them
    ("llama-stray-bias", "LlamaForCausalLM", dict(bias=True, config_extra={"attention_bias": False})),
    ("mistral-stray-bias", "MistralForCausalLM", dict(bias=True, config_extra={
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "attention_bias": True})),
    # both keys: transformers takes the scaling from rope_scaling (the layer once took rope_parameters')
    ("rope-scaling-and-parameters", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        config_extra={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})),
]


@pytest.mark.parametrize(("cls_name", "case"), [(c, k) for _, c, k in LLAMA_HF_CASES],
                         ids=[i for i, _, _ in LLAMA_HF_CASES])
def test_llama_matches_transformers(tmp_path, hf, cls_name, case):
    write_llama(tmp_path / "ckpt", **case)
    model = _hf_model(hf, tmp_path / "ckpt", cls_name)
    dev = load_layer("dec", tmp_path / "ckpt", 1).to("cpu")
    n = 11
    x = torch.randn(2, n, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.stack([torch.arange(n), torch.arange(n) * 9 + 40])  # gaps, and beyond 64
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    causal = torch.zeros(n, n, dtype=torch.float64).masked_fill(future, float("-inf"))
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, positions)
        ref = model.model.layers[1].self_attn(x, position_embeddings=cos_sin,
                                              attention_mask=causal.expand(2, 1, n, n))[0]
    y = dev.forward(x, causal=True, positions=positions)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5)


LLAMA3_8K = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
ROPE_CONFIGS = [  # (id, model_type, config.json fields)
    ("theta", "llama", {"rope_theta": 5e5}),
    ("linear", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("llama3", "llama", {"rope_theta": 5e5, "rope_scaling": LLAMA3_8K, "max_position_embeddings": 131072}),
    ("llama3-length-from-max", "llama", {"rope_scaling": {k: v for k, v in LLAMA3_8K.items()
                                                          if k != "original_max_position_embeddings"},
                                         "max_position_embeddings": 2048}),
    ("llama3-top-level-length-wins", "llama", {"rope_scaling": LLAMA3_8K, "original_max_position_embeddings": 2048}),
    ("mixtral-default-theta", "mixtral", {}),
    ("mistral-default", "mistral", {}),
    ("qwen2-theta", "qwen2", {"rope_theta": 1e6}),
    ("theta-in-rope-scaling", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}}),
    ("scaling-and-parameters", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}),
    ("parameters", "llama", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 2e4}}),
]


@pytest.mark.parametrize(("model_type", "fields"), [c[1:] for c in ROPE_CONFIGS], ids=[c[0] for c in ROPE_CONFIGS])
def test_rope_frequencies_are_transformers_own(hf, model_type, fields):
    """The layer's RoPE inv_freq equals transformers' rotary embedding's bit for bit, for the same
    config.json: theta from where transformers takes it (rope_scaling over rope_parameters, then the
    top level, then the model type's default: Mixtral's 1e6), llama3's pretraining length, and
    float32 arithmetic (float64 rounded once differed by an ulp: 4e-3 off at position 1e5)."""
    import importlib

    from service.layers.families import _rope

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **fields}
    ours = _rope(json.loads(json.dumps({"model_type": model_type, **config})), model_type, 16, "x").inv_freq
    hf_config = hf.AutoConfig.for_model(model_type, **json.loads(json.dumps(config)))
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))(config=hf_config)
    assert ours.dtype == rotary.inv_freq.dtype == torch.float32
    assert torch.equal(ours, rotary.inv_freq), (ours, rotary.inv_freq)


def test_a_window_the_config_leaves_out_is_the_config_class_default(hf):
    """Mistral's sliding_window when config.json has no such key: transformers' MistralConfig
    default (4096), not none; Mixtral's default is none."""
    from service.layers.families import sliding_window

    assert sliding_window({"model_type": "mistral"}, "mistral", 0) == hf.MistralConfig().sliding_window == 4096
    assert sliding_window({"model_type": "mixtral"}, "mixtral", 0) is hf.MixtralConfig().sliding_window is None
    assert sliding_window({"model_type": "qwen2"}, "qwen2", 0) is None  # (use_sliding_window is off)


def test_mistral_sliding_window_matches_transformers(tmp_path, hf):
    """N = 40 > sliding_window = 16: the layer equals MistralAttention under transformers' own
    sliding-window causal mask (``masking_utils.create_sliding_window_causal_mask``)."""
    from transformers import masking_utils

    write_llama(tmp_path / "ckpt", config_extra={"model_type": "mistral", "sliding_window": 16,
                                                  "architectures": ["MistralForCausalLM"]})
    model = _hf_model(hf, tmp_path / "ckpt", "MistralForCausalLM")
    dev = load_layer("dec", tmp_path / "ckpt", 1).to("cpu")
    assert dev.sliding_window == 16
    n = 40
    x = torch.randn(2, n, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.arange(n).expand(2, n)
    mask = masking_utils.create_sliding_window_causal_mask(
        config=model.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions,
        allow_is_causal_skip=False)
    if mask.dtype == torch.bool:  # an eager mask is additive
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    assert mask[0, 0, 39, 23] < -1e300 and mask[0, 0, 39, 24] == 0  # itself and the W - 1 keys before
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, positions)
        ref = model.model.layers[1].self_attn(x, position_embeddings=cos_sin, attention_mask=mask)[0]
    y = dev.forward(x, causal=True, positions=positions)
    torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5)


def test_docs_layer_specs_parse():
    """docs/layers.md's --layer examples are specs the service accepts, and its family table is current."""
    doc = (Path(__file__).resolve().parents[2] / "docs/layers.md").read_text()
    specs = re.findall(r"--layer (\S+=\S+:\d+)", doc)
    assert specs and all(parse_layer_spec(s) for s in specs)
    for model_type in layers_mod.FAMILY_OF:
        assert f"`{model_type}`" in doc, f"docs/layers.md does not list model_type {model_type!r}"
