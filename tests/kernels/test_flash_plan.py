"""What the flash launcher decides before launching: its plan never depends on the batch size
(batched answers equal lone ones bit for bit), and after ``freeze_autotuning()`` a key the
autotuner never saw runs its first config instead of being tuned on the request path; a tuned key
keeps its config. ``_tuned_already`` rebuilds triton's own autotuning key, so it is checked
against the key triton itself stored."""

from __future__ import annotations

import pytest
import torch

from kernels import flash, launch, plan

needs_interpreter = pytest.mark.skipif(not flash.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")

# (Hq, Hkv, Nq, Nk): decode with GQA, decode MHA, short prefill, long decode
PLAN_SHAPES = [(32, 8, 1, 8192), (8, 8, 1, 1024), (8, 8, 1024, 1024), (32, 32, 1, 65536)]


@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_plan_does_not_depend_on_batch(shape):
    plans = {flash.plan(b, *shape, torch.device("cpu")) for b in (1, 2, 16, 64)}
    assert len(plans) == 1


@pytest.mark.parametrize("shape", PLAN_SHAPES)
def test_flash_v1_key_slices_do_not_depend_on_batch(shape):
    from kernels import flash_v1

    hq, _, n_q, n_k = shape
    assert len({flash_v1._splits(b, hq, n_q, n_k, 128, torch.device("cpu"), None) for b in (1, 2, 16, 64)}) == 1


def test_decode_splits_the_keys():
    _, splits, _ = flash.plan(1, 32, 8, 1, 8192, torch.device("cpu"))
    assert splits > 1


@pytest.mark.parametrize("hq, hkv, n_k", [(32, 8, 8192), (32, 8, 65536), (8, 8, 4096), (4, 4, 4096)])
def test_decode_splits_fill_one_wave_per_batch_element(hq, hkv, n_k):
    """The fewest splits whose programs cover every SM once: on the H200 one wave beat two at
    B = 1 and at B = 16 (docs/benchmarks/kernels.md)."""
    cpu = torch.device("cpu")
    pack, splits, kps = flash.plan(1, hq, hkv, 1, n_k, cpu)
    programs = hq // pack  # one row block each: pack·Nq <= 16 rows
    sms = plan._num_sms(cpu)
    assert sms <= programs * splits < sms + programs
    assert splits * kps >= n_k > (splits - 1) * kps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_d", [64, 128])
def test_the_16bit_split_kernel_has_one_config(dtype, block_d):
    """Tuning could not see B (the plan may not depend on it), so a tuned decode config came from
    whatever batch size was tuned first, and at B = 1 every config times alike within the host's
    noise: one measured config instead, the same in every process."""
    q = torch.empty(1, 1, 1, block_d, dtype=dtype)
    assert len(flash.kern._prune_split(None, {"Q": q}, BLOCK_D=block_d)) == 1


@pytest.mark.parametrize("hq, n_q", [(32, 1), (8, 64), (64, 64)])
def test_merge_row_tile_does_not_depend_on_batch(monkeypatch, hq, n_q):
    """The merge's row tile decides how each row's splits are summed; it once came from B·Hq·Nq."""
    monkeypatch.setattr(launch, "_INTERPRETED", False)
    tiles = set()
    monkeypatch.setattr(flash, "launch_plain", lambda fn, grid, args, consts, **kw: tiles.add(consts["RB"]))
    for b in (1, 3, 100):
        parts = torch.empty(4, b, hq, n_q, 128), torch.empty(4, b, hq, n_q)
        flash.combine(*parts, torch.empty(b, hq, n_q, 128), torch.empty(b, hq, n_q))
    assert len(tiles) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 80])
def test_batched_decode_equals_lone_requests_bit_for_bit(batch):
    """At B = 80 the merge has more than 16 rows per SM, where it used to take another row tile."""
    import kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, 8192, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    o, lse = kernels.attention(q, k, v, return_lse=True)
    for i in (0, 5, batch - 1):
        o_i, lse_i = kernels.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], return_lse=True)
        assert torch.equal(o[i : i + 1], o_i) and torch.equal(lse[i : i + 1], lse_i)


@pytest.fixture
def fake_tuning(monkeypatch):
    """Let the real triton Autotuner run on the CPU: no timing, one candidate config."""
    flash.freeze_autotuning(False)  # an engine started earlier in this process froze it
    monkeypatch.setattr(launch, "_INTERPRETED", False)  # take launch()'s GPU branches
    tuned = flash.kern.attn_fwd_tuned
    monkeypatch.setattr(tuned, "cache", {})
    monkeypatch.setattr(tuned, "_bench", lambda *a, config, **k: [1.0, 1.0, 1.0])
    small = [c for c in tuned.configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64][:1]
    monkeypatch.setattr(tuned, "prune_configs", lambda kwargs, nargs=None: small)
    calls = []
    real_launch = flash.launch

    def recording_launch(t, grid, args, meta, first):
        calls.append((t, args, meta, launch._tuned_already(t, args, meta)))
        real_launch(t, grid, args, meta, first)

    monkeypatch.setattr(flash, "launch", recording_launch)
    yield tuned, calls
    flash.freeze_autotuning(False)


def _qkv(dtype, n=16, d=32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, d, generator=g).to(dtype) for _ in range(3)]


@needs_interpreter
def test_key_matches_triton_and_frozen_keys_are_not_tuned(fake_tuning):
    tuned, calls = fake_tuning
    q, k, v = _qkv(torch.float32)
    flash.flash_forward(q, k, v, causal=False, scale=0.2)  # tuned now: triton stores its own key
    assert len(tuned.cache) == 1
    flash.flash_forward(q, k, v, causal=False, scale=0.2)
    assert calls[0][3] is False and calls[1][3] is True, "our key must equal the one triton stored"

    flash.freeze_autotuning()
    q16, k16, v16 = _qkv(torch.float16)
    o, _ = flash.flash_forward(q16, k16, v16, causal=True, scale=0.2)  # an unseen key (dtype, causal)
    assert len(tuned.cache) == 1, "a frozen autotuner must not tune a new key"
    assert calls[-1][3] is False and torch.isfinite(o).all()


def test_short_keys_at_d64_get_narrow_key_blocks(fake_tuning, monkeypatch):
    """Under 512 keys at D <= 64 the autotuner chooses among the narrow-key configs only, 128/32
    first: what an untuned launch (ATTNSERVE_AUTOTUNE=0, or a key unseen when frozen) runs. The
    prune reads N_K_BUCKET, so the untuned path must hand it every named argument too."""
    tuned, calls = fake_tuning
    monkeypatch.setenv("ATTNSERVE_AUTOTUNE", "0")
    picks = {}
    for n, d in ((128, 64), (511, 40), (512, 64), (128, 128)):
        q, k, v = _qkv(torch.float16, n=n, d=d)
        flash.flash_forward(q, k, v, causal=False, scale=0.2)
        t, args, meta, _ = calls[-1]
        cfg, launched = launch._choose_config(t, None, args, meta, args[0].device)
        picks[n, d] = (cfg["BLOCK_M"], cfg["BLOCK_N"])
        assert not launched
    assert picks[128, 64] == picks[511, 40] == (128, 32)
    assert picks[512, 64] == (128, 128) and picks[128, 128] == (128, 128), "the general lists' first"


@needs_interpreter
@pytest.mark.parametrize("forward", ["flash", "flash_v1"])
def test_out_of_range_lengths_are_clamped_by_the_launchers(forward):
    """check_inputs reads kv_lengths only on the host; on a device the launchers clamp to [0, Nk],
    so a length past Nk never lets the unmasked loop read past the keys."""
    from kernels import flash_v1
    from kernels.reference import reference_attention

    fn = flash.flash_forward if forward == "flash" else flash_v1.flash_v1_forward
    q, k, v = _qkv(torch.float32, n=17)
    q, k, v = (t.expand(3, -1, -1, -1).contiguous() for t in (q, k, v))
    o, lse = fn(q, k, v, causal=False, scale=0.3, kv_lengths=torch.tensor([40, -2, 9], dtype=torch.int32))
    o_ref, lse_ref = reference_attention(q, k, v, causal=False, scale=0.3, kv_lengths=torch.tensor([17, 0, 9]))
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))


# ---- why flash chose a kernel: each Hopper predicate names its refusal, and the first launch of a
# problem class logs the kernel chosen with the refusals of the faster ones


def _on_hopper(monkeypatch, hopper_gpu: bool = True):
    """The predicates as a Hopper GPU (or another GPU) would answer for these CPU tensors."""
    from kernels import hopper

    monkeypatch.setattr(launch, "_INTERPRETED", False)
    monkeypatch.setattr(hopper, "_hopper", lambda device: hopper_gpu)


def test_gluon_refusals_say_why(monkeypatch):
    from kernels import hopper

    q, k, v = (torch.empty(2, 4, 4096, 128, dtype=torch.float16) for _ in range(3))
    _on_hopper(monkeypatch, False)
    assert hopper.gluon_refusal(q, k, v, False, 1, 1) == "not sm_90"
    _on_hopper(monkeypatch)
    cases = {
        None: (q, k, v, False, 1, 1),
        "head_dim 64 is not a multiple of 8 in 72..256": (q[..., :64], k[..., :64], v[..., :64], False, 1, 1),
        "not float16/bfloat16": (q.float(), k.float(), v.float(), False, 1, 1),
        "a decode plan (GQA rows packed or keys split)": (q, k, v, False, 4, 1),
        "min(Nq, Nk) < GLUON_MIN_N": (q[:, :, :100], k, v, False, 1, 1),
        "causal and Nk < GLUON_MIN_N_CAUSAL or Nq < GLUON_MIN_N": (q[:, :, :1000], k[:, :, :1000], v[:, :, :1000],
                                                                   True, 1, 1),
        "k: a descriptor not 16-byte aligned, or a stride TMA cannot say": (q, k[:1].expand(2, -1, -1, -1), v,
                                                                           False, 1, 1),
    }
    assert hopper.gluon_refusal(q[:, :, :256], k, v, True, 1, 1) is None, "a chunked prefill: 256 rows, 4k keys"
    for reason, args in cases.items():
        assert hopper.gluon_refusal(*args) == reason
        assert hopper.gluon_path(*args) == (reason is None)
    monkeypatch.setattr(launch, "_INTERPRETED", True)
    assert hopper.gluon_refusal(q, k, v, False, 1, 1) == "Triton's interpreter cannot run Gluon"


def test_tma_refusals_say_why(monkeypatch):
    from kernels import hopper

    q, k, v = (torch.empty(1, 2, 2048, 64, dtype=torch.float16) for _ in range(3))
    _on_hopper(monkeypatch)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    cases = {
        None: (q, k, v, False, 0.1, 1, 1),
        "causal": (q, k, v, True, 0.1, 1, 1),
        "scale <= 0 (its loop takes the row max before scaling)": (q, k, v, False, -0.1, 1, 1),
        "a decode plan (GQA rows packed or keys split)": (q, k, v, False, 0.1, 1, 2),
        "not float16/bfloat16": (q.float(), k.float(), v.float(), False, 0.1, 1, 1),
        "head_dim is not 64 or 128": (q[..., :40], k[..., :40], v[..., :40], False, 0.1, 1, 1),
        "min(Nq, Nk) < TMA_MIN_N": (q[:, :, :100], k, v, False, 0.1, 1, 1),
        "q, k or v not 16-byte aligned, or its last dim not contiguous": (flat[1:].view(q.shape), k, v, False,
                                                                         0.1, 1, 1),
    }
    for reason, args in cases.items():
        assert hopper.tma_refusal(*args) == reason
        assert hopper.tma_path(*args) == (reason is None)
    _on_hopper(monkeypatch, False)
    assert hopper.tma_refusal(q, k, v, False, 0.1, 1, 1) == "not sm_90"


def test_decode_refusals_say_why(monkeypatch):
    from kernels import hopper

    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(2, 8, 8192, 128, dtype=torch.bfloat16) for _ in range(2))
    _on_hopper(monkeypatch)
    cases = {
        None: (q, k, v, 4, 16),
        "not a decode plan (no GQA rows packed, no keys split)": (q, k, v, 1, 1),
        "more than 64 rows a program (GQA group x Nq)": (q.expand(2, 32, 17, 128), k, v, 4, 1),
        "head_dim is not 64 or 128": (q[..., :96], k[..., :96], v[..., :96], 4, 16),
        "not float16/bfloat16": (q.float(), k.float(), v.float(), 4, 16),
        "an empty tensor (a TMA descriptor has no empty dims)": (q[:0], k[:0], v[:0], 4, 16),
        "k: a descriptor not 16-byte aligned, or a stride TMA cannot say": (q, k[:1].expand(2, -1, -1, -1), v,
                                                                           4, 16),
    }
    for reason, args in cases.items():
        assert hopper.decode_refusal(*args) == reason
        assert hopper.decode_path(*args) == (reason is None)
    _on_hopper(monkeypatch, False)
    assert hopper.decode_refusal(q, k, v, 4, 16) == "not sm_90"


@pytest.fixture
def choices(monkeypatch, caplog):
    """The kernel choices flash logs from now on (a fresh record of lines already logged)."""
    monkeypatch.setattr(plan, "_told", set())
    caplog.set_level("INFO", logger="attnserve.kernels")
    return lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("flash kernel")]


@needs_interpreter
def test_flash_logs_its_choice_and_the_refusals_once(choices):
    q, k, v = _qkv(torch.float16, n=64, d=64)
    flash.flash_forward(q, k, v, causal=True, scale=0.2)
    flash.flash_forward(q, k, v, causal=True, scale=0.2)
    flash.flash_forward(q, k, v, causal=False, scale=0.2, tma=True)
    flash.flash_forward(q, k, v, causal=False, scale=0.2, tma=False)
    q1 = q[:, :, :1]
    flash.flash_forward(q1, k, v, causal=False, scale=0.2, num_splits=1)
    assert choices() == [
        "flash kernel for float16 Hq 2 Hkv 2 D 64 prefill causal on cpu: attn_fwd (refused: attn_fwd_ws: "
        "head_dim 64 is not a multiple of 8 in 72..256; attn_fwd_tma: causal)",
        "flash kernel for float16 Hq 2 Hkv 2 D 64 prefill on cpu: attn_fwd_tma (refused: attn_fwd_ws: "
        "head_dim 64 is not a multiple of 8 in 72..256)",
        "flash kernel for float16 Hq 2 Hkv 2 D 64 prefill on cpu: attn_fwd (refused: attn_fwd_ws: tma=False; "
        "attn_fwd_tma: tma=False)",
        "flash kernel for float16 Hq 2 Hkv 2 D 64 prefill on cpu: attn_fwd (refused: attn_fwd_ws: "
        "head_dim 64 is not a multiple of 8 in 72..256; attn_fwd_tma: min(Nq, Nk) < TMA_MIN_N)",
    ]


@needs_interpreter
def test_a_decode_logs_once_whatever_its_key_count(choices):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=g).half()
    for n_k in (600, 700, 900):
        k, v = (torch.randn(1, 2, n_k, 64, generator=g).half() for _ in range(2))
        flash.flash_forward(q, k, v, causal=False, scale=0.2)
    assert choices() == ["flash kernel for float16 Hq 4 Hkv 2 D 64 decode (GQA rows packed, keys split) on cpu: "
                         "attn_fwd (refused: attn_decode: Triton's interpreter cannot run Gluon)"]


def test_reasons_are_worked_out_only_when_logged(monkeypatch, caplog):
    def never():
        raise AssertionError("refusals worked out with INFO off")

    monkeypatch.setattr(plan, "_told", set())
    caplog.set_level("WARNING", logger="attnserve.kernels")
    q = torch.empty(1, 2, 1, 64)
    plan.tell(q, q, False, False, 1, 1, "attn_fwd", never)
