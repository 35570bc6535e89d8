"""Python client of the native HTTP API (docs/api.md#http-api): torch tensors in, torch tensors out, over
safetensors (the fast path).

    from service.client import AttentionClient
    with AttentionClient("http://localhost:8000", api_key=None) as client:
        o = client.attention(q, k, v, causal=True)                 # q: (B, Hq, Nq, D)
        o, lse = client.attention(q, k, v, return_lse=True)
        client.layers()                                            # [{"name", "family", ...}]
        y = client.call_layer("minilm0", x)                        # x: (B, N, hidden)
        client.ready()                                             # True once the server is warm
        with client.session(num_kv_heads=8, head_dim=128, dtype=torch.float16, layers=32) as s:
            o = s.step(q, k, v, layer=0)                           # sessions: service.client.sessions

Errors raise ``AttentionServiceError`` carrying the HTTP ``status``, the service's ``code`` and its
``message`` (and ``retry_after_s`` on 429); a 200 that is not a safetensors file gives ``bad_answer``.
A call that gets no answer raises it too, as a gateway would answer (and as ``GrpcAttentionClient``
raises): 503 ``unavailable`` (no connection, or one cut mid-answer), 504 ``deadline_exceeded`` (the
client's ``timeout``).
"""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import orjson
import torch
import urllib3

from service.client.sessions import SessionsMixin, checked_affinity
from service.errors import ServiceError
from service.wire import SESSION_HEADER
from service.wire.tensors import parse_safetensors, safetensors_parts, uninitialized_bytearray

SAFETENSORS = "application/x-safetensors"


class AttentionServiceError(Exception):
    """An error answer of the service: ``status`` (HTTP), ``code`` (e.g. "invalid_input"), ``message``."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s


def _parts(tensors: dict[str, torch.Tensor | None]) -> list[memoryview]:
    """Tensors -> a safetensors file as buffers: its header, then each tensor's bytes as a view of
    its own memory (sent in turn, never joined; ``attention(x, x, x)`` sends x's bytes three times),
    where safetensors' own ``save`` would build the whole body in one new buffer first."""
    return safetensors_parts({name: t for name, t in tensors.items() if t is not None})


def _read_body(r: urllib3.BaseHTTPResponse) -> bytearray:
    """The whole answer into one writable buffer sized by Content-Length (the tensors returned are
    views of it: no copy after the socket's).

    Read through http.client's response under urllib3's: urllib3's ``readinto`` reads into a new
    ``bytes`` and copies that, and http.client's ``read(n)`` does the same once more, each a fresh
    buffer to fault in (what that costs a large answer: docs/benchmarks/service.md#latency).
    The server never compresses."""
    length = r.headers.get("content-length")
    if length is None:
        return bytearray(r.read())
    buf = uninitialized_bytearray(int(length))
    raw = getattr(r, "_fp", None)
    direct = isinstance(raw, http.client.HTTPResponse) and "content-encoding" not in r.headers
    readinto = raw.readinto if direct else r.readinto
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = readinto(view[got:])
        if not n:
            raise urllib3.exceptions.ProtocolError(f"the answer ended after {got} of {len(buf)} bytes")
        got += n
    return buf


@contextlib.contextmanager
def _reaching(base: str) -> Iterator[None]:
    """urllib3's errors of a call that got no answer -> AttentionServiceError (503 / 504)."""
    try:
        yield
    except urllib3.exceptions.NewConnectionError as exc:  # (a ConnectTimeoutError in urllib3 2)
        raise AttentionServiceError(503, "unavailable", f"could not connect to {base}: {exc}") from exc
    except urllib3.exceptions.TimeoutError as exc:
        raise AttentionServiceError(504, "deadline_exceeded",
                                    f"no answer from {base} within the client's timeout: {exc}") from exc
    except urllib3.exceptions.HTTPError as exc:
        raise AttentionServiceError(503, "unavailable", f"no answer from {base}: {exc}") from exc
    except (ConnectionError, http.client.HTTPException) as exc:  # cut while the answer is read (a reset)
        raise AttentionServiceError(503, "unavailable", f"the connection to {base} broke: {exc!r}") from exc


def _affinity_header(affinity: str | None) -> dict[str, str]:
    return {} if affinity is None else {SESSION_HEADER: affinity}


def _bool(value: Any) -> str:
    """A bool option's query value; anything but a bool goes as its text, for the server to read
    as it reads every transport's ("false", 0, ...) or refuse in its words."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)



def mask_params(window_size: Sequence[int] | None, softcap: float | None) -> dict[str, str]:
    """The score modifiers as query parameters (window_size "L,R"); None sends nothing (the
    server's default, off). Values are sent as given: the server checks them."""
    params = {}
    if window_size is not None:
        params["window_size"] = ",".join(str(w) for w in window_size)
    if softcap is not None:
        params["softcap"] = repr(softcap) if isinstance(softcap, float) else str(softcap)
    return params

class AttentionClient(SessionsMixin):
    """A synchronous client (urllib3, connection pooling); safe to share between threads.

    urllib3 rather than httpx: httpx is many times slower on large safetensors calls and no faster
    on small ones (docs/benchmarks/service.md#latency). POSTs are never retried (a retried
    call costs the GPU twice).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        request_timeout_ms: float | None = None,
        session_affinity: str | None = None,
    ):
        """``session_affinity``: the x-attnserve-session header of every session call (default:
        the call's session id; service.client.sessions.SessionsMixin)."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.session_affinity = checked_affinity(session_affinity)
        api_key = api_key.strip() if api_key else api_key  # (as the server reads a key file's)
        headers = {"X-API-Key": api_key} if api_key else {}
        if request_timeout_ms is not None:
            headers["X-Request-Timeout-Ms"] = str(request_timeout_ms)
        self._base = base_url.rstrip("/")
        self._http = urllib3.PoolManager(
            maxsize=16, headers=headers, retries=False, timeout=urllib3.Timeout(total=timeout)
        )

    def close(self) -> None:
        self._http.clear()

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _post(
        self, path: str, tensors: dict[str, torch.Tensor | None], params: dict[str, str],
        headers: dict[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        parts = _parts(tensors)
        with _reaching(self._base):
            r = self._http.request(
                "POST",
                f"{self._base}{path}?{urlencode(params)}",
                body=parts,
                headers={
                    **self._http.headers,
                    **(headers or {}),
                    "Content-Type": SAFETENSORS,
                    "Content-Length": str(sum(len(p) for p in parts)),  # sent as is, not chunked
                },
                preload_content=False,
            )
            try:
                self._raise_for_error(r)  # an error answer is read whole: the connection stays usable
                body = _read_body(r)
            except AttentionServiceError:
                raise
            except BaseException:
                r.close()  # what is left of the answer must not stay on a pooled connection
                raise
            finally:
                r.release_conn()
        try:
            return parse_safetensors(body)[0]
        except ServiceError as exc:
            message = f"the answer is not a safetensors file: {exc}"
            raise AttentionServiceError(r.status, "bad_answer", message) from None

    def _get(self, path: str) -> urllib3.BaseHTTPResponse:
        with _reaching(self._base):
            return self._http.request("GET", f"{self._base}{path}")

    @staticmethod
    def _raise_for_error(r: urllib3.BaseHTTPResponse) -> None:
        if r.status < 400:
            return
        code, message = "http_error", r.data.decode(errors="replace")
        retry = None
        try:
            err = orjson.loads(r.data)["error"]
            code, message = (err["code"], err["message"]) if isinstance(err, dict) else (code, str(err))
            if isinstance(err, dict) and err.get("retry_after_s") is not None:
                retry = float(err["retry_after_s"])  # the body's: not rounded up to whole seconds
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
        if retry is None:
            try:  # seconds, as this service sends; a proxy may send an HTTP date instead
                retry = float(r.headers["retry-after"])
            except (KeyError, ValueError):
                retry = None
        raise AttentionServiceError(r.status, code, message, retry)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        scale: float | None = None,
        kv_lengths: torch.Tensor | None = None,
        return_lse: bool = False,
        layout: str = "bhnd",
        kernel: str = "auto",
        window_size: Sequence[int] | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q: (B, Hq, Nq, D), k/v: (B, Hkv, Nk, D) ((B, N, H, D) with layout="bnhd") -> o [, lse].
        window_size (left, right), softcap, alibi_slopes float32 (Hq,) or (B, Hq): flash-attn's score
        modifiers (docs/api.md#attention-semantics); None: the server's default (off)."""
        params = {
            "causal": _bool(causal),
            "return_lse": _bool(return_lse),
            "layout": layout,
            "kernel": kernel,
            **mask_params(window_size, softcap),
        }
        if scale is not None:
            params["scale"] = repr(float(scale))
        out = self._post("/attention", {"q": q, "k": k, "v": v, "kv_lengths": kv_lengths,
                                        "alibi_slopes": alibi_slopes}, params)
        return (out["o"], out["lse"]) if return_lse else out["o"]

    def layers(self) -> list[dict[str, Any]]:
        r = self._get("/layers")
        self._raise_for_error(r)
        return orjson.loads(r.data)["layers"]

    def call_layer(
        self,
        name: str,
        x: torch.Tensor,
        causal: bool = False,
        positions: torch.Tensor | None = None,
        kv_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, N, hidden) -> y: (B, N, hidden)."""
        out = self._post(
            f"/layers/{quote(name, safe='')}",
            {"x": x, "positions": positions, "kv_lengths": kv_lengths},
            {"causal": _bool(causal)},
        )
        return out["y"]

    def ready(self) -> bool:
        try:
            return self._get("/readyz").status == 200
        except AttentionServiceError:  # no answer
            return False

    # ---- sessions (docs/api.md#sessions; the shared logic: service.client.sessions) ----------------------

    def _json_call(self, method: str, path: str, doc: Any, affinity: str) -> urllib3.BaseHTTPResponse:
        headers = {**self._http.headers, **_affinity_header(affinity)}
        if doc is not None:
            headers["Content-Type"] = "application/json"
        with _reaching(self._base):
            r = self._http.request(method, f"{self._base}{path}", body=None if doc is None else orjson.dumps(doc),
                                   headers=headers)
        self._raise_for_error(r)
        return r

    def _create_session(self, fields: dict[str, Any], affinity: str) -> dict[str, Any]:
        doc = {name: value for name, value in fields.items() if value is not None}
        return orjson.loads(self._json_call("POST", "/sessions", doc, affinity).data)

    def _session_step(self, sessions: list[str], tensors: dict[str, torch.Tensor | None], options: dict[str, Any],
                      affinity: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        options = dict(options)
        params = mask_params(options.pop("window_size", None), options.pop("softcap", None))
        params.update({name: _bool(value) if isinstance(value, bool) else str(value)
                       for name, value in options.items() if value is not None})
        if "scale" in options and options["scale"] is not None:
            params["scale"] = repr(float(options["scale"]))
        if "q_lengths" in tensors:  # a packed step
            params["sessions"] = ",".join(sessions)
            path = "/sessions/attend"
        else:
            path = f"/sessions/{quote(sessions[0], safe='')}/attend"
        out = self._post(path, tensors, params, _affinity_header(affinity))
        return out["o"], out.get("lse")

    def _get_session(self, session: str, affinity: str) -> dict[str, Any]:
        return orjson.loads(self._json_call("GET", f"/sessions/{quote(session, safe='')}", None, affinity).data)

    def _delete_session(self, session: str, affinity: str) -> None:
        self._json_call("DELETE", f"/sessions/{quote(session, safe='')}", None, affinity)
