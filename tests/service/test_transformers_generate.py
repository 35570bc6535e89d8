"""transformers' ``generate()`` of a tiny random Llama (fp32, CPU) with attention and KV cache served
by a real CPU server's sessions (service/client/transformers.py): greedy tokens identical to the
local model's, over HTTP and gRPC; a left-padded batch row for row; session lengths; sessions
deleted afterwards; the unsupported cases raise. Sliding-window models (a tiny Mistral, a Qwen2
mixing sliding and full layers) on prompts longer than their window, the same way. Right padding;
misuse (no attnserve attention, a backward), Ctrl-C mid-forward, mid-create and mid-close, and a
server that stopped answering: a clear error, and no session left behind."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time

import httpx
import pytest
import torch
from conftest import run_server

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation.utils import ALL_CACHE_NAMES  # noqa: E402

from service.client import AttentionClient, AttentionServiceError, GrpcAttentionClient  # noqa: E402
from service.client.transformers import SessionCache, attnserve_attention, use_attnserve  # noqa: E402

# head_dim 64 / 4 = 16, the warmed head dim; gRPC on (FAST turns it off)
SERVER_ARGS = ("--warmup-shapes", "1x1x16x16", "--warmup-dtypes", "float32", "--kv-page-tokens", "5")
NEW = 12
PAD = 0


def llama_config(**extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       pad_token_id=PAD, **extra)


@pytest.fixture(scope="module")
def models():
    """(local, served): the same random weights; local on sdpa, served on attnserve (own config)."""
    torch.manual_seed(0)
    local = LlamaForCausalLM(llama_config()).eval()
    served = LlamaForCausalLM(copy.deepcopy(local.config)).eval()
    served.load_state_dict(local.state_dict())
    local.set_attn_implementation("sdpa")
    return local, use_attnserve(served)


WINDOW = 8
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD)


def twin(cls, config):
    """(local on sdpa, served on attnserve): the same random weights, each its own config."""
    torch.manual_seed(0)
    local = cls(config).eval()
    served = cls(copy.deepcopy(config)).eval()
    served.load_state_dict(local.state_dict())
    local.set_attn_implementation("sdpa")
    return local, use_attnserve(served)


@pytest.fixture(scope="module")
def mistral():
    return twin(MistralForCausalLM, MistralConfig(sliding_window=WINDOW, **TINY))


@pytest.fixture(scope="module")
def qwen2():
    """Layer 0 full attention, layer 1 a sliding window (``max_window_layers=1``)."""
    config = Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **TINY)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return twin(Qwen2ForCausalLM, config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("hf"), *SERVER_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with AttentionClient(server.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with GrpcAttentionClient(server.grpc_target, timeout=60.0) as c:
        yield c


def session_count(server) -> int:
    return httpx.get(server.url + "/sessions", timeout=60.0).json()["count"]


def prompt(n, seed):
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


# generate()'s name for the cache: ``cache`` from transformers 5 (the pinned one), ``past_key_values``
# before (the GPU image's)
CACHE_KW = ALL_CACHE_NAMES[0]


@torch.no_grad()
def generate(model, ids, **kwargs):
    if "cache" in kwargs:
        kwargs[CACHE_KW] = kwargs.pop("cache")
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_generate_equals_the_local_model(models, server, http, grpc_client, transport):
    """Greedy tokens identical to the local model's; each layer of the session holds prompt +
    generated - 1 tokens (the last token is never fed back); no session left afterwards."""
    local, served = models
    client = http if transport == "http" else grpc_client
    ids = prompt(9, seed=1)[None]
    want = generate(local, ids)
    with SessionCache(client, served, batch_size=1) as cache:
        got = generate(served, ids, cache=cache)
        assert client.get_session(cache.sessions[0])["lengths"] == [9 + NEW - 1] * 2
        assert cache.get_seq_length() == 9 + NEW - 1
    assert got.shape == (1, 9 + NEW)
    assert torch.equal(got, want), (got, want)
    assert session_count(server) == 0


def test_left_padded_batch_equals_the_local_model_row_for_row(models, server, http):
    """Two prompts of different lengths, left-padded: tokens equal the local model's on the same
    padded batch and each prompt generated alone; pads never enter a session."""
    local, served = models
    a, b = prompt(7, seed=2), prompt(4, seed=3)
    ids = torch.full((2, 7), PAD, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 3:], mask[1, 3:] = b, 1
    want = generate(local, ids, attention_mask=mask)
    with SessionCache(http, served, batch_size=2) as cache:
        got = generate(served, ids, attention_mask=mask, cache=cache)
        assert [http.get_session(s)["lengths"] for s in cache.sessions] == [[7 + NEW - 1] * 2, [4 + NEW - 1] * 2]
    assert torch.equal(got, want), (got, want)
    for row, alone in ((got[0], generate(local, a[None])[0]), (got[1, 3:], generate(local, b[None])[0])):
        # a row that reached eos (token 2) alone stops there; in the batch it goes on with pads
        assert torch.equal(row[:len(alone)], alone) and bool((row[len(alone):] == PAD).all()), (row, alone)
    assert session_count(server) == 0


def test_a_cache_continues_over_two_generate_calls(models, http):
    """A second ``generate`` on the same cache sends only the tokens the sessions do not hold."""
    local, served = models
    ids = prompt(6, seed=4)[None]
    with SessionCache(http, served, batch_size=1) as cache:
        first = generate(served, ids, cache=cache)
        more = torch.cat([first, prompt(3, seed=5)[None]], 1)
        second = generate(served, more, cache=cache)
        assert http.get_session(cache.sessions[0])["lengths"] == [more.shape[1] + NEW - 1] * 2
    assert torch.equal(first, generate(local, ids))
    assert torch.equal(second, generate(local, more))


def test_unsupported_cases_raise_and_leave_no_session(models, server, http):
    local, served = models
    ids = prompt(5, seed=6)[None]
    with pytest.raises(RuntimeError, match="SessionCache"):  # attnserve without its cache
        generate(served, ids)
    with SessionCache(http, served, batch_size=1) as cache:
        with pytest.raises(NotImplementedError, match="output_attentions"):
            generate(served, ids, cache=cache, output_attentions=True, return_dict_in_generate=True)
        with pytest.raises(RuntimeError, match="an earlier step failed"):  # its positions no longer add up
            generate(served, ids, cache=cache)
    with SessionCache(http, served, batch_size=1) as cache, pytest.raises(NotImplementedError, match="pattern"):
        served(ids, attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool), cache=cache)  # bidirectional
    with SessionCache(http, served, batch_size=2) as cache, pytest.raises(ValueError, match="batch"):
        generate(served, ids, cache=cache)
    dropout = LlamaForCausalLM(copy.deepcopy(served.config)).train()
    dropout.config.attention_dropout = 0.1
    for layer in dropout.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with SessionCache(http, dropout, batch_size=1) as cache, pytest.raises(NotImplementedError, match="dropout"):
        dropout(ids, cache=cache)
    # keys changed between the cache's update and the attention call: an error, not a wrong answer
    with SessionCache(http, served, batch_size=1) as cache:
        k = v = torch.zeros(1, 2, 1, 16)
        cache.update(k, v, 0)
        with pytest.raises(RuntimeError, match="not the ones"):
            attnserve_attention(served.model.layers[0].self_attn, torch.zeros(1, 4, 1, 16), k.clone(), v, None)
    assert session_count(server) == 0
    for bad, match in ((dict(attention_chunk_size=4), "attention_chunk_size"), (dict(is_causal=False), "causal"),
                       (dict(layer_types=["full_attention", "chunked_attention"]), "layer types"),
                       (dict(sliding_window=-3), "sliding_window"),
                       (dict(sliding_window=0, layer_types=["full_attention", "sliding_attention"]), "sliding_window"),
                       (dict(num_kv_shared_layers=1), "num_kv_shared_layers"),
                       (dict(kv_lora_rank=16), "latent attention")):
        config = llama_config()
        for name, value in bad.items():
            setattr(config, name, value)
        with pytest.raises(NotImplementedError, match=match):
            SessionCache(http, config)
    with pytest.raises(NotImplementedError, match=r"not torch.float64: cast the model"):
        SessionCache(http, LlamaForCausalLM(llama_config()).double())
    assert session_count(server) == 0


def test_generate_modes_the_sessions_cannot_serve_fail_the_cache_first(models, server, http):
    """use_cache=False (generate then feeds the whole sequence again each step, with the cache) raises
    before a token reaches the server. Beam search (reorders the cache) and prompt lookup (crops it)
    raise after a forward that sent tokens: the cache is left failed, so a retry on it raises instead
    of generating over those tokens. A SessionCache cannot be deep-copied (transformers' prompt-reuse
    recipe): a clear error."""
    local, served = models
    ids = prompt(9, seed=21)[None]
    with SessionCache(http, served, batch_size=1) as cache:
        with pytest.raises(NotImplementedError, match="use_cache=True"):
            generate(served, ids, cache=cache, use_cache=False)
        assert cache.sessions[0].info()["lengths"] == [0, 0]
    for kwargs, error in ((dict(num_beams=2), NotImplementedError), (dict(prompt_lookup_num_tokens=3), ValueError)):
        with SessionCache(http, served, batch_size=kwargs.get("num_beams", 1)) as cache:
            with pytest.raises(error):
                generate(served, torch.cat([ids, ids], 1), cache=cache, **kwargs)
            assert cache._failed is not None, kwargs
            with pytest.raises(RuntimeError, match="an earlier step failed"):
                generate(served, ids.expand(cache.batch_size, -1), cache=cache)
    with SessionCache(http, served, batch_size=1) as cache:
        generate(served, ids, cache=cache)
        assert cache.is_croppable is False and cache._failed is None  # asked outside assisted decoding (mps)
        with pytest.raises(NotImplementedError, match="cannot be copied"):
            copy.deepcopy(cache)
        assert copy.copy(cache).sessions == cache.sessions  # a shallow copy shares them, as DynamicCache's
    assert session_count(server) == 0


def test_a_config_writing_0_for_no_sliding_window_is_served(server, http):
    """Qwen2-MoE writes sliding_window 0 when its sliding window is off (every layer full): served,
    greedy tokens equal to the local model's."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, use_sliding_window=False)
    assert config.sliding_window == 0
    local, served = twin(Qwen2MoeForCausalLM, config)
    ids = prompt(9, seed=12)[None]
    want = generate(local, ids)
    with SessionCache(http, served, batch_size=1) as cache:
        got = generate(served, ids, cache=cache)
    assert torch.equal(got, want), (got, want)
    assert session_count(server) == 0


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_generate_equals_the_local_model(request, server, http, grpc_client, transport, family):
    """A prompt of 20 tokens and 12 new ones over a window of 8: greedy tokens identical to the
    local model's (sdpa, transformers' sliding mask); the window matters (the same weights without
    it give other logits); the sessions hold every token; none left afterwards."""
    local, served = request.getfixturevalue(family)
    client = http if transport == "http" else grpc_client
    ids = prompt(20, seed=7)[None]
    config = copy.deepcopy(local.config)
    config.sliding_window = None
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    full = type(local)(config).eval()
    full.load_state_dict(local.state_dict())
    full.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert not torch.allclose(local(ids).logits[0, -1], full(ids).logits[0, -1], atol=1e-4)
    want = generate(local, ids)
    with SessionCache(client, served, batch_size=1) as cache:
        got = generate(served, ids, cache=cache)
        assert client.get_session(cache.sessions[0])["lengths"] == [20 + NEW - 1] * 2
    assert torch.equal(got, want), (got, want)
    assert session_count(server) == 0


def test_sliding_window_left_padded_batch_equals_the_local_model(mistral, server, http):
    """Prompts of 20 and 13 tokens, left-padded, over a window of 8: the window counts real tokens
    only (as transformers' mask does for left pads); tokens equal the local model's on the same
    batch, and each row's equal its prompt generated alone."""
    local, served = mistral
    a, b = prompt(20, seed=8), prompt(13, seed=9)
    ids = torch.full((2, 20), PAD, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 7:], mask[1, 7:] = b, 1
    want = generate(local, ids, attention_mask=mask)
    with SessionCache(http, served, batch_size=2) as cache:
        got = generate(served, ids, attention_mask=mask, cache=cache)
        assert [http.get_session(s)["lengths"] for s in cache.sessions] == [[20 + NEW - 1] * 2, [13 + NEW - 1] * 2]
    assert torch.equal(got, want), (got, want)
    for row, alone in ((got[0], generate(local, a[None])[0]), (got[1, 7:], generate(local, b[None])[0])):
        assert torch.equal(row[:len(alone)], alone) and bool((row[len(alone):] == PAD).all()), (row, alone)
    assert session_count(server) == 0


def test_a_sliding_layer_refuses_another_mask(mistral, models, server, http):
    """A sliding layer given a plain causal mask longer than its window, and a full layer given a
    sliding mask, raise: the mask must be the layer's own pattern."""
    _, served = mistral
    n = 2 * WINDOW
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with SessionCache(http, served, batch_size=1) as cache, pytest.raises(NotImplementedError, match="window of 8"):
        served(prompt(n, seed=10)[None], attention_mask=causal, cache=cache)
    _, llama = models
    sliding = causal & ~torch.ones(n, n, dtype=torch.bool).tril(-WINDOW)[None, None]
    with SessionCache(http, llama, batch_size=1) as cache, pytest.raises(NotImplementedError, match="pattern"):
        llama(prompt(n, seed=10)[None], attention_mask=sliding, cache=cache)
    assert session_count(server) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_generate_with_a_real_layer_count(tmp_path):
    """On the GPU: a random Llama of 32 layers, Llama-3-8B's heads (GQA 32/8, head dim 128) and a
    small hidden state, in bfloat16 on CUDA; the server on the GPU (the paged kernels). Greedy
    tokens equal the local model's on sdpa for the same weights."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=4096, intermediate_size=512, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024,
                         pad_token_id=PAD)
    local = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    served = LlamaForCausalLM(copy.deepcopy(config)).to(device="cuda", dtype=torch.bfloat16).eval()
    served.load_state_dict(local.state_dict())
    local.set_attn_implementation("sdpa")
    use_attnserve(served)
    ids = prompt(100, 11)[None].cuda()
    with run_server(tmp_path, "--device", "cuda:0", "--warmup-shapes", "1x8x128x128", "--warmup-dtypes",
                    "bfloat16") as s, GrpcAttentionClient(s.grpc_target, timeout=120.0) as client:
        want = generate(local, ids)
        with SessionCache(client, served, batch_size=1) as cache:
            got = generate(served, ids, cache=cache)
        assert session_count(s) == 0
    assert torch.equal(got, want), (got, want)


# ---- misuse, interrupts and failures ------------------------------------------------------------------------------


def test_a_session_cache_without_attnserve_attention_raises(models, server, http):
    """A SessionCache given to a model on sdpa (its keys would never reach the sessions) raises, made from
    the model (at the first layer) or from its config (at the next layer's update), instead of generating
    other tokens; ``use_attnserve`` on a model that cannot switch its attention (GPT-Neo) raises."""
    local, _ = models
    ids = prompt(8, seed=12)[None]
    for source in (local, local.config):
        with SessionCache(http, source, batch_size=1) as cache, pytest.raises(RuntimeError, match="attnserve"):
            generate(local, ids, cache=cache)
    assert session_count(server) == 0
    neo = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
        bos_token_id=1, eos_token_id=2)).eval()
    with pytest.raises(NotImplementedError, match="attention implementation"):
        use_attnserve(neo)


def test_an_interrupt_between_layers_marks_the_cache_failed(models, server, http):
    """A KeyboardInterrupt in layer 0's MLP, after layer 0's step reached the server, leaves the layers
    at different lengths: the next forward on the cache raises "an earlier step failed" (one new token,
    where no mask checks the lengths, and a shorter input) instead of attending to mismatched keys."""
    _, served = models
    armed = []

    def interrupt(module, args, output):
        if armed:
            armed.clear()
            raise KeyboardInterrupt

    hook = served.model.layers[0].mlp.register_forward_hook(interrupt)
    try:
        with SessionCache(http, served, batch_size=1) as cache:
            first = generate(served, prompt(6, seed=13)[None], cache=cache)
            more = torch.cat([first, prompt(3, seed=14)[None]], 1)
            armed.append(True)
            with pytest.raises(KeyboardInterrupt):
                generate(served, more, cache=cache)
            for ids in (torch.cat([more, prompt(1, seed=15)[None]], 1), more[:, :4]):
                with pytest.raises(RuntimeError, match="an earlier step failed"):
                    generate(served, ids, cache=cache)
    finally:
        hook.remove()
    assert session_count(server) == 0


def right_padded(lengths, seed):
    """(ids, mask) of prompts of ``lengths`` tokens, right-padded to the longest."""
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = prompt(n, seed=seed + i), 1
    return ids, mask


def test_a_right_padded_batch_equals_the_local_model(models, mistral, server, http):
    """Right padding: a pad after a row's last real token attends to the tokens its session holds, as the
    local model's pad does (the first new token of that row is predicted from it): tokens equal the local
    model's, on a sliding-window model too while the row fits its window; a pad whose window would
    hide some of its row's tokens raises."""
    local, served = models
    ids, mask = right_padded([9, 5], seed=16)
    want = generate(local, ids, attention_mask=mask)
    with SessionCache(http, served, batch_size=2) as cache:
        got = generate(served, ids, attention_mask=mask, cache=cache)
        assert [http.get_session(s)["lengths"] for s in cache.sessions] == [[9 + NEW - 1] * 2, [5 + NEW - 1] * 2]
    assert torch.equal(got, want), (got, want)
    local, served = mistral
    ids, mask = right_padded([6, 3], seed=18)  # 6 + 2 new within the window of 8: every token in sight
    with SessionCache(http, served, batch_size=2) as cache, torch.no_grad():
        got = served.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, **{CACHE_KW: cache})
    with torch.no_grad():
        assert torch.equal(got, local.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False))
    ids, mask = right_padded([14, 3], seed=20)  # the last pads of row 1 are more than 8 after its tokens
    with SessionCache(http, served, batch_size=2) as cache, pytest.raises(NotImplementedError, match="right pad"):
        generate(served, ids, attention_mask=mask, cache=cache)
    assert session_count(server) == 0


def test_a_backward_through_attnserve_attention_raises(models, http):
    """The server's attention has no backward: in train mode (no dropout), ``loss.backward()`` raises
    instead of leaving q/k/v projections without gradients; a forward with grad enabled still answers."""
    local, served = models
    ids = prompt(6, seed=22)[None]
    with SessionCache(http, served, batch_size=1) as cache:
        logits = served(ids, cache=cache).logits
        with torch.no_grad():
            assert torch.allclose(logits, local(ids).logits, atol=1e-5)
        with pytest.raises(RuntimeError, match="no backward"):
            logits.sum().backward()
    trained = LlamaForCausalLM(copy.deepcopy(served.config)).train()
    with SessionCache(http, trained, batch_size=1) as cache, pytest.raises(RuntimeError, match="no backward"):
        trained(ids, labels=ids, cache=cache).loss.backward()


class InterruptedClient(AttentionClient):
    """A real client whose ``create_at``-th create is interrupted once the server has answered it, and
    whose ``delete_at``-th delete is interrupted before it is sent (as a Ctrl-C landing there)."""

    def __init__(self, *args, create_at=0, delete_at=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.creates, self.deletes, self.create_at, self.delete_at = 0, 0, create_at, delete_at

    def _create_session(self, fields, affinity):
        info = super()._create_session(fields, affinity)
        self.creates += 1
        if self.creates == self.create_at:
            raise KeyboardInterrupt
        return info

    def _delete_session(self, session, affinity):
        self.deletes += 1
        if self.deletes == self.delete_at:
            raise KeyboardInterrupt
        super()._delete_session(session, affinity)


def test_an_interrupt_while_creating_or_closing_leaves_no_session(models, server):
    """Ctrl-C after the server created a row's session, before the client read the answer: the failed
    SessionCache deletes that session too. Ctrl-C during ``close()`` stops it; the sessions it did not
    delete stay in ``cache.sessions``, and a second ``close()`` deletes them."""
    _, served = models
    with InterruptedClient(server.url, create_at=3) as client, pytest.raises(KeyboardInterrupt):
        SessionCache(client, served, batch_size=5)
    assert session_count(server) == 0
    with InterruptedClient(server.url, delete_at=2) as client:
        cache = SessionCache(client, served, batch_size=5)
        with pytest.raises(KeyboardInterrupt):
            cache.close()
        assert len(cache.sessions) == 4  # the first deleted, the interrupted one and the rest kept
        cache.close()
        assert cache.sessions == []
    assert session_count(server) == 0


@contextlib.contextmanager
def stopped(server):
    """The server process stopped (SIGSTOP: it takes connections and answers nothing), then resumed."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def test_close_against_a_server_that_stopped_answering(models, server):
    """A server that stopped answering: ``close()`` of 4 rows returns after one client timeout (its first
    delete got no answer), not one per row, keeping the sessions it did not delete, which a later
    ``close()`` deletes. A Ctrl-C while it waits keeps them too."""
    _, served = models
    with GrpcAttentionClient(server.grpc_target, timeout=1.0) as client:
        cache = SessionCache(client, served, batch_size=4)
        with stopped(server):
            start = time.monotonic()
            with pytest.raises(AttentionServiceError, match="deadline"):
                cache.close()
            assert time.monotonic() - start < 2.5
        assert len(cache.sessions) == 4
        cache.close()
    assert session_count(server) == 0
    with AttentionClient(server.url, timeout=5.0) as client:
        cache = SessionCache(client, served, batch_size=3)
        deletes = []

        def interrupted(session, affinity):  # a Ctrl-C while the first delete waits for its answer
            deletes.append(session)
            raise KeyboardInterrupt

        # (raised in the call, not sent as a signal: a suite started in the background by a
        # non-interactive shell, `make test &`, inherits SIGINT ignored, and a SIGINT then does nothing)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(client, "_delete_session", interrupted)
            with pytest.raises(KeyboardInterrupt):
                cache.close()
        assert len(deletes) == 1 and len(cache.sessions) == 3
        cache.close()
    assert session_count(server) == 0


def test_leaving_the_with_block_keeps_the_body_error(models, server, http):
    """An error in the ``with`` body reaches the caller even when ``close()`` then fails too (here the
    client's channel is closed); close()'s error is a note on it, and the sessions stay listed."""
    _, served = models
    client = GrpcAttentionClient(server.grpc_target, timeout=60.0)
    with pytest.raises(KeyError, match="the real cause") as raised:
        with SessionCache(client, served, batch_size=2) as cache:
            ids = [s.id for s in cache.sessions]
            client.close()
            raise KeyError("the real cause")
    assert any("close()" in note for note in getattr(raised.value, "__notes__", [])), raised.value
    for sid in ids:
        http.delete_session(sid)
    assert session_count(server) == 0


def test_a_session_cache_refuses_an_empty_batch_and_serves_autocast(models, server, http):
    """``batch_size`` 0 or -1 is a clear ValueError before any session is made. Under
    ``torch.autocast(bfloat16)`` (an fp32 model's values come out bf16, its keys fp32 after RoPE) the
    keys and values are sent in the sessions' dtype: tokens equal the local model's under autocast."""
    local, served = models
    for rows in (0, -1):
        with pytest.raises(ValueError, match="batch_size"):
            SessionCache(http, served, batch_size=rows)
    ids = prompt(7, seed=24)[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = generate(local, ids)
        with SessionCache(http, served, batch_size=1) as cache:
            got = generate(served, ids, cache=cache)
    assert torch.equal(got, want), (got, want)
    assert session_count(server) == 0


def test_gemma2_soft_capped_sliding_and_full_layers_equal_the_local_model(server, http):
    """A tiny Gemma 2 (alternating sliding and full layers, ``attn_logit_softcapping``): the steps
    carry its soft cap, and greedy tokens equal the local model's on eager attention (sdpa takes no
    cap); a small cap, so the cap decides (it was refused at the first forward)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**{**TINY, "num_hidden_layers": 2}, head_dim=16, sliding_window=WINDOW,
                          attn_logit_softcapping=0.5, query_pre_attn_scalar=16)
    torch.manual_seed(0)
    local = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in local.model.layers:  # scores of a few units, where a cap of 0.5 bends them
            layer.self_attn.q_proj.weight.mul_(30)
    served = Gemma2ForCausalLM(copy.deepcopy(config)).eval()
    served.load_state_dict(local.state_dict())
    local.set_attn_implementation("eager")
    use_attnserve(served)
    ids = prompt(20, seed=9)[None]
    uncapped = copy.deepcopy(local)
    uncapped.config.attn_logit_softcapping = None
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        assert not torch.allclose(local(ids).logits[0, -1], uncapped(ids).logits[0, -1], atol=1e-3)
    want = generate(local, ids)
    with SessionCache(http, served, batch_size=1) as cache:
        got = generate(served, ids, cache=cache)
    assert torch.equal(got, want), (got, want)
    assert session_count(server) == 0


def test_a_dropped_cache_never_blocks_the_collecting_thread(models, server):
    """The finalizer of a dropped SessionCache deletes on a thread of its own: collected while the
    server answers nothing, it returns at once (it waited out the client's timeout on whatever thread
    collected it, swallowing a Ctrl-C meanwhile); the sessions go once the server answers again."""
    import gc

    _, served = models
    with AttentionClient(server.url, timeout=5.0) as client:
        cache = SessionCache(client, served, batch_size=2)
        assert session_count(server) == 2
        with stopped(server):
            del cache
            start = time.monotonic()
            gc.collect()
            assert time.monotonic() - start < 2.5
        deadline = time.monotonic() + 30
        while session_count(server) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert session_count(server) == 0


def test_a_dropped_cache_deletes_its_sessions_and_a_non_causal_module_is_named(models, server, http):
    """A SessionCache used as a DynamicCache is (no with, no close()) deletes its sessions once
    collected (they stayed until --session-idle-s). An encoder's (non-causal) attention call says it
    is not causal (it said a SessionCache was needed, though one was given)."""
    import gc

    _, served = models
    cache = SessionCache(http, served, batch_size=2)
    generate(served, prompt(6, seed=3)[None].expand(2, -1), cache=cache)
    assert session_count(server) == 2
    del cache
    gc.collect()  # (its finalizer deletes them on a thread of its own: never on the collecting one)
    deadline = time.monotonic() + 30
    while session_count(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_count(server) == 0
    encoder = torch.nn.Module()
    encoder.is_causal = False
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(NotImplementedError, match="not causal"):
        attnserve_attention(encoder, q, q, q, None)
