"""Hugging Face transformers on attnserve sessions: a Llama-family model's (Mistral's, Qwen2's)
``generate()`` with its attention computed, and its KV cache held, by the server.

    from service.client import AttentionClient
    from service.client.transformers import SessionCache, use_attnserve

    use_attnserve(model)                                 # config._attn_implementation = "attnserve"
    with AttentionClient(url) as client, SessionCache(client, model, batch_size=2) as cache:
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=20, do_sample=False)

``SessionCache`` is a transformers ``Cache`` with one server session per batch row (one session
layer per decoder layer); it keeps only lengths. Its ``update`` stages a layer's new keys and
values, and the registered attention function ``attnserve_attention`` sends them with the layer's
queries in one packed step of every row (one call per layer per forward), so the server appends
them and answers causal attention over everything the row holds. Padded batches work: pad
positions, read from the 4-D mask, never enter a session; a pad after a row's last real token (right
padding) attends to every real token the row holds, as the model's own pad does, other pads give zeros.

Sliding-window layers (Mistral's ``sliding_window``; Qwen2's ``use_sliding_window``, whose
``layer_types`` mix ``"sliding_attention"`` and ``"full_attention"``) step with
``window_size=(W - 1, 0)``: a query sees itself and the W - 1 tokens before it, as transformers'
sliding mask (key j visible to query i iff i - W < j <= i) does; full layers step with
``(-1, -1)``. The session holds every token; the window is applied by the server. A layer's soft
cap (Gemma 2's ``attn_logit_softcapping``) is the steps' ``softcap``.

Not supported (a clear error, never a silent wrong answer): dropout, a backward through the
attention (training), ``output_attentions``, chunked (``attention_chunk_size``) or non-causal
attention, layer types other than full and sliding attention, additive attention biases, beam
search and other cache reordering, cropping (assisted decoding), and a model whose attention is
not ``"attnserve"``.

A cache dropped without ``close()`` deletes its sessions when it is collected.

This module imports transformers; ``service.client`` does not import this module.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
import weakref
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from service.client.sessions import Session, dtype_name

__all__ = ["ATTN_IMPLEMENTATION", "SessionCache", "SessionLayer", "attnserve_attention", "use_attnserve"]

ATTN_IMPLEMENTATION = "attnserve"

# The entry ``SessionCache.update`` staged for the attention call that follows it in the same layer
# forward: the cache has no other way to reach the attention function (the model passes it the
# keys and values, not the cache). Per thread, so that two models generating in two threads keep
# their entries apart.
_staged = threading.local()


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def check_supported(config: Any) -> None:
    """Raise ``NotImplementedError`` for a config whose attention the sessions cannot serve: only
    causal attention, full or over a sliding window (``sliding_window``, ``layer_types`` of
    ``"full_attention"`` and ``"sliding_attention"``), is."""
    config = _text_config(config)
    if not getattr(config, "is_causal", True):
        raise NotImplementedError("attnserve sessions serve causal attention only; this config is not causal")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("attnserve sessions serve full or sliding-window attention only; this config "
                                  f"sets attention_chunk_size={config.attention_chunk_size}")
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if window == 0 and type(window) is int and "sliding_attention" not in layer_types:
        window = None  # (Qwen2-MoE writes 0 for "no sliding window": every layer attends in full)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise NotImplementedError(f"attnserve needs sliding_window to be a positive int; this config sets {window!r}")
    if getattr(config, "kv_lora_rank", None):
        raise NotImplementedError("attnserve sessions keep each head's keys and values; this config's attention is "
                                  "multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3), whose cache holds "
                                  "compressed latents")
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared:
        raise NotImplementedError(f"attnserve sessions keep each layer's own keys and values; this config's last "
                                  f"{shared} layers reuse earlier layers' (num_kv_shared_layers, Gemma 3n)")
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise NotImplementedError("attnserve sessions serve full or sliding-window attention only; this config "
                                  f"has layer types {other}")
    if "sliding_attention" in layer_types and window is None:
        raise NotImplementedError("this config has sliding_attention layers but no sliding_window")


def use_attnserve(model: Any) -> Any:
    """Switch ``model`` to the ``"attnserve"`` attention implementation (registered on import of
    this module); return the model. Its ``generate`` then needs ``cache=SessionCache(...)``."""
    check_supported(model.config)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    # transformers only logs a warning for a model that cannot switch (its attention does not go
    # through AttentionInterface: Falcon, Bloom, GPT-Neo); it would then ignore the sessions
    found = getattr(_text_config(model.config), "_attn_implementation", None)
    if found != ATTN_IMPLEMENTATION:
        raise NotImplementedError(f"{type(model).__name__} cannot switch its attention implementation to "
                                  f"{ATTN_IMPLEMENTATION!r} (it stays {found!r}): its attention does not go through "
                                  "transformers' AttentionInterface, so attnserve cannot serve it")
    return model


class SessionLayer(CacheLayerMixin):
    """One decoder layer's view of the sessions: lengths only, the keys and values live on the server.

    ``length`` is the layer's length as transformers counts it (pad positions included, what the
    masks are sized by); ``held`` [B] is what each row's session holds (pads left out); ``real``
    (B, length) bool which of the positions entered the session (False: a pad)."""

    is_sliding = False
    is_croppable = False  # the server cannot drop a session's last tokens
    is_compileable = False

    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size
        self.length = 0
        self.held = [0] * batch_size
        self.real = torch.zeros(batch_size, 0, dtype=torch.bool)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, n, D) -> the same tensors: they reach the server in the attention call."""
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask, as for ``DynamicLayer``: every past position, then the new ones."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass  # nothing is held here

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        raise NotImplementedError("a SessionCache cannot be reset: its sessions hold the keys; make a new SessionCache")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("a SessionCache cannot drop tokens (crop): the server's sessions only grow; "
                                      "assisted decoding is not supported")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a SessionCache cannot reorder its rows: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("a SessionCache cannot repeat its rows (num_return_sequences > 1 or beams): "
                                      "make it for the prompts' rows times n")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a SessionCache cannot select rows")


class SessionCache(Cache):
    """A transformers ``Cache`` whose keys and values live in server sessions: one session per batch
    row, one session layer per decoder layer.

    ``SessionCache(client, model_or_config, batch_size=1, dtype=None)``: ``client`` an
    ``AttentionClient`` or ``GrpcAttentionClient``; the config gives the layers,
    ``num_key_value_heads`` and ``head_dim``; ``dtype`` the sessions' dtype (default the model's, or
    the config's, else float32), which the model's keys and values must have (under
    ``torch.autocast`` they are cast to it). A context manager: the sessions are deleted on exit
    (``close()``), and an error of the ``with`` body is the one raised (an error of ``close()``
    becomes a note on it).
    """

    def __init__(self, client: Any, model_or_config: Any, batch_size: int = 1,
                 dtype: torch.dtype | str | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1 (the model's batch rows), got {batch_size!r}")
        config = getattr(model_or_config, "config", model_or_config)
        check_supported(config)
        text = _text_config(config)
        # a model's own config tells, at each update, whether its attention is attnserve's
        self._model_config = text if hasattr(model_or_config, "config") else None
        if dtype is None:
            dtype = getattr(model_or_config, "dtype", None) if hasattr(model_or_config, "config") else None
            dtype = dtype or getattr(text, "dtype", None) or torch.float32  # (torch_dtype: a deprecated alias)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype_name(dtype), dtype)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise NotImplementedError(f"attnserve sessions hold float16, bfloat16 or float32 keys, not {dtype}: "
                                      "cast the model (e.g. model.float()) or pass dtype=")
        self.client = client
        self.dtype: torch.dtype = dtype
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        super().__init__(layers=[SessionLayer(batch_size) for _ in range(self.num_layers)])
        self.sessions: list[Session] = []
        self._failed: BaseException | None = None
        self._closed = False
        self._staged_layer: int | None = None  # a layer whose update has not reached attnserve_attention yet
        group = uuid.uuid4().hex  # the batch's sessions share a group: one server process holds them all
        try:
            for i in range(batch_size):
                self.sessions.append(client.create_session(self.num_kv_heads, self.head_dim, dtype,
                                                           layers=self.num_layers, session=f"{group}:{i}"))
        except BaseException as exc:
            if len(self.sessions) < batch_size:
                # the server may have made the row that failed (a Ctrl-C before its answer was read)
                self.sessions.append(Session(client, f"{group}:{len(self.sessions)}", self.num_layers,
                                             self.num_kv_heads, self.head_dim, dtype_name(dtype)))
            try:
                self.close()
            except Exception as error:
                exc.add_note(f"SessionCache.close() also failed: {error!r}")
            raise
        # a cache dropped without close() (used as a DynamicCache is) deletes what it holds when collected;
        # not at interpreter exit, where a server that stopped answering would hold the exit a timeout
        weakref.finalize(self, _delete_left, self.sessions).atexit = False

    @property
    def batch_size(self) -> int:
        return len(self.layers[0].held)

    @property
    def is_croppable(self) -> bool:
        """False. Assisted decoding and prompt lookup (transformers' ``_assisted_decoding``) ask after
        a forward that sent their draft tokens to the sessions: the cache is unusable from then on.
        Other readers (greedy decoding on mps asks too) leave it usable."""
        if sys._getframe(1).f_code.co_name == "_assisted_decoding" and any(layer.length for layer in self.layers):
            self._failed = self._failed or NotImplementedError(
                "assisted decoding and prompt lookup drop draft tokens from the cache (crop), which a SessionCache "
                "cannot: its sessions now hold them")
        return False

    def _refusing(self, operation: Any, *args: Any) -> None:
        """Run a cache operation of transformers' (its layers raise for what the sessions cannot do),
        leaving the cache unusable when it raises: the forward before it has already sent its
        tokens (beam search reorders after the prompt)."""
        try:
            operation(*args)
        except NotImplementedError as exc:
            self._failed = self._failed or exc
            raise

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refusing(super().reorder_cache, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._refusing(super().crop, tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refusing(super().batch_repeat_interleave, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refusing(super().batch_select_indices, indices)

    def __deepcopy__(self, memo: dict) -> SessionCache:
        raise NotImplementedError("a SessionCache cannot be copied: its keys and values live in server sessions, "
                                  "which cannot be forked; prefill a new SessionCache for each prompt")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, Hkv, n, D) of layer ``layer_idx`` -> the same tensors, staged for the attention
        call that follows (which sends them to the server with the queries)."""
        self._check_usable()
        found = getattr(self._model_config, "_attn_implementation", ATTN_IMPLEMENTATION)
        if found != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"this SessionCache's model runs attention {found!r}, not {ATTN_IMPLEMENTATION!r}: "
                               "its keys would never reach the sessions; call use_attnserve(model) first")
        if self._staged_layer is not None:
            self._fail(RuntimeError(f"the keys staged for layer {self._staged_layer} never reached attnserve "
                                    "attention: the model's attention implementation is not attnserve "
                                    "(use_attnserve(model)), or its forward stopped between the two"))
        if layer_idx == 0 and len({layer.length for layer in self.layers}) > 1:
            # layer 0 starts a forward: a forward that stopped between layers (an exception or a
            # Ctrl-C outside the attention call) left its first layers longer than the others
            self._fail(RuntimeError("a forward stopped between layers: the layers hold "
                                    f"{[layer.length for layer in self.layers]} positions"))
        b, hkv, _, d = key_states.shape
        if b != self.batch_size:
            raise ValueError(f"the model's batch is {b} rows, the SessionCache was made for {self.batch_size} "
                             "(with num_return_sequences = n, make it for the prompts' rows times n; beam search "
                             "is not supported)")
        if (hkv, d) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"keys (B, {hkv}, n, {d}) do not fit the sessions' (Hkv, D) = "
                             f"({self.num_kv_heads}, {self.head_dim})")
        # under autocast the keys (RoPE's float32) and values (the projection's lower precision) may
        # differ; _step sends both in the sessions' dtype, as autocast lets attention choose its own
        if not torch.is_autocast_enabled(key_states.device.type):
            for name, t in (("keys", key_states), ("values", value_states)):
                if t.dtype != self.dtype:
                    raise ValueError(f"the model's {name} are {dtype_name(t.dtype)}, the sessions "
                                     f"{dtype_name(self.dtype)}: make the SessionCache in the model's dtype "
                                     f"(dtype={dtype_name(t.dtype)}), cast the model, or run it under "
                                     f"torch.autocast(..., dtype=torch.{dtype_name(self.dtype)})")
        past = self.layers[layer_idx].length
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        self._staged_layer = layer_idx
        _staged.entry = (self, layer_idx, keys, values, past)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The cached positions (pads included); raises once a step failed (they no longer match the
        sessions), before transformers slices a prompt by them."""
        self._check_usable()
        return super().get_seq_length(layer_idx)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError("this SessionCache's sessions no longer match the model's positions: "
                               f"an earlier step failed ({self._failed!r}); make a new SessionCache")
        if self._closed:
            raise RuntimeError("this SessionCache is closed: its sessions are deleted")

    def _fail(self, exc: BaseException) -> None:
        """Mark the cache unusable for ``exc`` and raise as a later use would."""
        self._failed = exc
        self._check_usable()

    def close(self) -> None:
        """Delete the sessions (an already ended one is not an error), then raise the first error. A
        session leaves ``sessions`` once deleted: what an error or a Ctrl-C left there, a later
        ``close()`` deletes. A delete that got no answer (a timeout, a refused connection, a server
        unavailable) ends the close there: the others would each wait the client's timeout too."""
        self._closed = True
        errors = []
        for s in list(self.sessions):
            try:
                s.delete(missing_ok=True)
            except Exception as exc:
                errors.append(exc)
                if not _answered(exc):
                    break
            else:
                self.sessions.remove(s)
        if errors:
            raise errors[0]

    def __enter__(self) -> SessionCache:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:  # the body's error is the one to see; close()'s rides along on it
            exc.add_note(f"SessionCache.close() also failed: {error!r}; "
                         f"{len(self.sessions)} sessions stay in .sessions")

    def _step(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              past: int, attention_mask: torch.Tensor | None, scaling: float | None,
              sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q (B, Hq, n, D), k/v (B, Hkv, n, D) -> o (B, n, Hq, D): one packed step of every row that
        has a real (not pad) new token, with ``window_size=(W - 1, 0)`` for ``sliding_window`` W (else
        ``(-1, -1)``) and ``softcap``; then, for pads after a row's last real token (right padding), one q-only
        non-causal packed step over all the row holds. Other pads' o are zeros."""
        layer = self.layers[layer_idx]
        b, hq, n, d = query.shape
        # (B, n) bool each: which positions are real; which are pads after a row's last real token
        new, tail = _new_tokens(attention_mask, b, n, past, layer.real, sliding_window)
        device = query.device
        out = torch.zeros(b, n, hq, d, dtype=query.dtype, device=device)
        q_lengths = new.sum(1).tolist()
        rows = [i for i in range(b) if q_lengths[i] > 0]
        if rows:
            real = new.to(device)
            # (B, n) boolean index over the (B, n, H, D) views packs each row's real tokens, in order
            q = query.transpose(1, 2)[real].to("cpu", self.dtype)
            k = keys.transpose(1, 2)[real].to("cpu", self.dtype)
            v = values.transpose(1, 2)[real].to("cpu", self.dtype)
            o = self.client.packed_step([self.sessions[i] for i in rows], q, k, v, [q_lengths[i] for i in rows],
                                        layer=layer_idx, scale=scaling, softcap=softcap,
                                        window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0))
            out[real] = o.to(device, query.dtype)
        for i in range(b):
            layer.held[i] += q_lengths[i]
        layer.real = torch.cat([layer.real, new], 1)
        t_lengths = tail.sum(1).tolist()
        t_rows = [i for i in range(b) if t_lengths[i] > 0]
        if t_rows:
            pads = tail.to(device)
            q = query.transpose(1, 2)[pads].to("cpu", self.dtype)
            o = self.client.packed_step([self.sessions[i] for i in t_rows], q, None, None,
                                        [t_lengths[i] for i in t_rows], layer=layer_idx, scale=scaling, causal=False,
                                        softcap=softcap)
            out[pads] = o.to(device, query.dtype)
        return out


def _delete_left(sessions: list[Session]) -> None:
    """A collected SessionCache's sessions that ``close()`` did not delete: deleted on a thread of
    their own. The collection runs wherever the garbage collector happens to run: deleting there
    held that thread up to a client timeout (a server that stopped answering), and a Ctrl-C landing
    meanwhile was swallowed as an exception in a finalizer."""
    if sessions:
        with contextlib.suppress(RuntimeError):  # the interpreter is shutting down: no new thread
            threading.Thread(target=_delete_quietly, args=(sessions,), name="attnserve-dropped-cache",
                             daemon=True).start()


def _delete_quietly(sessions: list[Session]) -> None:
    """Best effort: a delete that fails ends it (the server ends the rest after ``--session-idle-s``)."""
    for s in list(sessions):
        try:
            s.delete(missing_ok=True)
        except Exception:  # noqa: BLE001 - at collection or exit there is no one to tell
            return
        sessions.remove(s)


def _answered(exc: BaseException) -> bool:
    """Whether a failed call got the server's answer about it (a service error code), rather than none:
    a transport error, a timeout, or a server unavailable (stopped, draining)."""
    code = getattr(exc, "code", None)
    return isinstance(code, str) and code not in ("unavailable", "deadline_exceeded")


def _new_tokens(attention_mask: torch.Tensor | None, b: int, n: int, past: int, past_real: torch.Tensor,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, tail), (B, n) bool each: ``new`` which of the n new positions of each row are real tokens
    (enter the session); ``tail`` which are pads after the row's last real token (right padding),
    with real tokens before them.

    ``past_real`` (B, past): which past positions entered the sessions (the layer's record). The
    mask (B or 1, 1 or H, n, past + n), bool (True: attend) or additive float (0 or very negative),
    must be causal attention over the row's real positions: a new position is real when its query
    row sees itself (transformers' padding mask hides a pad from every row, its own included), and
    every real query row must see exactly the real positions up to its own; with ``window`` W, only
    the last W of them (its own included), counted in session positions (real tokens only), which is
    what the server's ``window_size=(W - 1, 0)`` attends. For left padding that is transformers'
    sliding mask (key j visible to query i iff i - W < j <= i). A ``tail`` pad's query row must see
    every real token of its row (transformers' padding mask, within the window if that covers them):
    the model predicts a right-padded row's next token there. Anything else (an attention bias,
    another window, a bidirectional block, a mask whose real past positions are not the sessions',
    a window that hides some of a tail pad's tokens) raises; pads elsewhere (left padding, holes)
    are not checked: their outputs are zeros."""
    if attention_mask is None:  # plain causal: every position real
        if not bool(past_real.all()):
            held = past_real.sum(1).tolist()
            raise ValueError("no attention mask, but the sessions hold fewer tokens than the cache's length "
                             f"({held} of {past}): a padded prompt needs its attention_mask on every call")
        return torch.ones(b, n, dtype=torch.bool), torch.zeros(b, n, dtype=torch.bool)
    mask = attention_mask.detach().cpu()
    if mask.ndim != 4 or mask.shape[-2] != n or mask.shape[-1] != past + n:
        raise NotImplementedError(f"attnserve needs a 4-D mask (B, 1, {n}, {past + n}); got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        attend = mask
    else:
        attend = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((attend | blocked).all()):
            raise NotImplementedError("attnserve cannot apply an additive attention bias (the mask has values other "
                                      "than 0 and -inf)")
    attend = attend.expand(b, -1, -1, -1)
    new = attend[:, 0, :, past:].diagonal(dim1=-2, dim2=-1)  # (B, n): a real query row sees itself
    real = torch.cat([past_real, new], 1)  # (B, past + n)
    causal = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    want = causal[None] & real[:, None, :]  # (B, n, past + n)
    if window is not None:
        # a real token's session position: how many real tokens come before it in its row
        pos = real.long().cumsum(1) - 1  # (B, past + n)
        want &= pos[:, None, :] > pos[:, past:, None] - window
    # pad query rows are left out: their outputs are discarded (zeros) whatever they attend to
    rows = new[:, None, :, None].expand(-1, attend.shape[1], -1, past + n)
    if not bool((attend == want[:, None]).logical_or(~rows).all()):
        seen = "causal attention" if window is None else f"causal attention in a sliding window of {window}"
        raise NotImplementedError(f"attnserve serves {seen} over a row's real tokens only (the tokens its session "
                                  "holds); the mask has another pattern (a window, a bidirectional block, a custom "
                                  "mask, or pads a sliding-window layer cannot leave out: pads inside a row, such as a "
                                  "continuation's own left pads, count in transformers' window but not in the "
                                  "session's; pad only the first prompt, on the left)")
    later = new.flip(1).long().cumsum(1).flip(1) > new.long()  # (B, n): a real new token comes after
    tail = ~new & ~later & (real.long().cumsum(1)[:, past:] > 0)
    pads = tail[:, None, :, None].expand(-1, attend.shape[1], -1, past + n)
    if not bool((attend == real[:, None, None, :]).logical_or(~pads).all()):
        raise NotImplementedError("attnserve serves a pad after a row's last real token (right padding) as attention "
                                  "over every real token of the row; this mask shows such a pad fewer (a sliding "
                                  "window shorter than the padded row): pad on the left")
    return new, tail


def attnserve_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q (B, Hq, n, D), k/v (B, Hkv, n, D) (the new tokens, as
    ``SessionCache.update`` returned them), mask (B, 1, n, past + n) or None -> (o (B, n, Hq, D), None).

    One packed step of every row on the server, layer ``module.layer_idx``, with ``scale=scaling``
    and, for a sliding layer (``sliding_window=W``, as transformers passes it), ``window_size=(W - 1, 0)``;
    a full layer's step has ``(-1, -1)``."""
    entry = getattr(_staged, "entry", None)
    _staged.entry = None
    if entry is None and kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        # an encoder's or a vision tower's attention: it never has a cache to stage its keys in
        config = getattr(module, "config", None)
        hint = ('give that part of the model another attention, e.g. model.set_attn_implementation({"text_config": '
                '"attnserve", "vision_config": "sdpa"})' if config is not None and hasattr(config, "vision_config")
                else "an encoder-decoder model's attention is not served")
        raise NotImplementedError(f"attnserve sessions serve causal (decoder) attention only; "
                                  f"{type(module).__name__} is not causal: {hint}")
    if entry is None:
        raise RuntimeError('attn_implementation "attnserve" needs cache=SessionCache(...) '
                           "(and use_cache): no keys were staged for this attention call")
    cache, layer_idx, keys, values, past = entry
    cache._staged_layer = None
    try:
        if kwargs.get("use_cache") is False:
            # generate() then feeds the whole sequence again at every step, with the cache: the
            # sessions would hold each token many times over
            raise NotImplementedError("attnserve attention runs over the sessions' keys: it needs use_cache=True "
                                      "(generate(..., use_cache=True); this model's generation_config or config may "
                                      "set use_cache=False); make a new SessionCache")
        if keys is not key or values is not value:
            raise RuntimeError("the keys given to attnserve_attention are not the ones SessionCache.update staged "
                               f"for layer {layer_idx}: the model changes them between the cache and the attention "
                               "call, which attnserve cannot serve")
        if getattr(module, "layer_idx", layer_idx) != layer_idx:
            raise RuntimeError(f"attention of layer {module.layer_idx} got the keys staged for layer {layer_idx}")
        window, cap = _check_options(module, dropout, kwargs)

        def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return cache._step(layer_idx, q, k, v, past, attention_mask, scaling, window, cap)

        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            return _ServedAttention.apply(step, query, key, value), None
        return step(query, key, value), None
    except BaseException as exc:
        # the cache counted this layer's new tokens in update; the sessions may not hold them
        cache._failed = exc
        raise


class _ServedAttention(torch.autograd.Function):
    """o = step(q, k, v), the server's answer, as a node of the autograd graph whose backward raises:
    without it a backward would pass over the attention silently, leaving q, k and v (and the
    projections before them) without gradients."""

    @staticmethod
    def forward(ctx: Any, step: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return step(query, key, value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise RuntimeError("attnserve attention has no backward: the server answers the forward only, so no "
                           "gradient reaches the queries, keys and values; train with a local attention "
                           '(model.set_attn_implementation("sdpa")), or run inference under torch.no_grad()')


def _check_options(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> tuple[int | None, float | None]:
    """Raise for what attnserve cannot serve; return the layer's sliding window W and its soft cap
    (Gemma 2's ``attn_logit_softcapping``), each None when off."""
    if dropout:
        raise NotImplementedError(f"attnserve attention has no dropout (got {dropout}); call model.eval()")
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        raise NotImplementedError("attnserve attention does not return attention weights (output_attentions)")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise NotImplementedError("attnserve sessions serve causal attention only")
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attnserve attention does not support {name}")
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise NotImplementedError(f"attnserve needs sliding_window to be a positive int; got {window!r}")
    cap = kwargs.get("softcap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not cap >= 0):
        raise NotImplementedError(f"attnserve needs softcap to be a number >= 0; got {cap!r}")
    return window, cap or None


AttentionInterface.register(ATTN_IMPLEMENTATION, attnserve_attention)
# The causal mask as sdpa gets it: None for a plain causal forward, else bool (True: attend)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
