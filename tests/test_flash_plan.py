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
    B = 1 and at B = 16 (docs/benchmarks/kernels.md, ninth session)."""
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
        cfg, launched = launch._choose_config(t, None, args, meta)
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
