"""One ``Settings`` object, built once at start-up from CLI flags and ``ATTNSERVE_*`` variables.

Precedence: command-line flag > environment variable > default.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, NoReturn

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LAYER_DTYPES = ("float16", "bfloat16", "float32")  # service.wire.tensors.FLOAT_DTYPES (this module imports no torch)


class Settings(BaseSettings):
    # inf and nan are no sizes or durations (an inf --max-body-mb overflowed at start)
    model_config = SettingsConfigDict(env_prefix="ATTNSERVE_", extra="forbid", allow_inf_nan=False)

    host: str = Field("0.0.0.0", description="address to bind HTTP and gRPC to")
    http_port: int = Field(
        8000, ge=1, le=65535, description="HTTP port (FastAPI: native API, Open Inference Protocol, health, metrics)"
    )
    grpc_port: int = Field(
        8001, ge=0, le=65535, description="gRPC port (attention.v1 and inference.GRPCInferenceService); 0 disables"
    )
    processes: int = Field(
        0, ge=0,
        description="server processes behind the same HTTP and gRPC ports, the devices dealt out among "
        "them (docs/deploy.md): each has its own event loop, so more processes answer more requests "
        "when the host side is the limit; 0: one per GPU of --device (one on the CPU)",
    )
    http_fd: int | None = Field(
        None, ge=0, description="accept HTTP on this inherited listening socket instead of binding "
        "--http-port (set by --processes for the processes it starts)",
    )
    peers: str | None = Field(
        None, description="this process's place among --processes' processes, INDEX/COUNT@FOLDER: session "
        "calls for another process go to its private sockets in FOLDER (set by --processes for the processes "
        "it starts)",
    )
    device: str = Field(
        "auto",
        description="'auto' (every visible GPU, else the CPU), 'cpu', 'cuda', "
        "or a list such as 'cuda:0,cuda:1'",
    )
    layer: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="model layer to serve, NAME=DIR:INDEX "
        "(a Hugging Face checkpoint folder and a layer index); repeatable (in the variable: several "
        "separated by commas, or a JSON list)",
    )
    layer_dtype: str | None = Field(
        None, description="dtype for layer weights (float16, bfloat16, float32); default: the checkpoint's"
    )
    batching: bool = Field(
        True, description="group compatible requests into one launch (off: one launch per request)"
    )
    max_batch_tokens: int = Field(
        65536, gt=0, description="a batch launches once its requests hold this many query tokens (B·Nq summed)"
    )
    max_batch_work_ms: float = Field(
        4.0, ge=0,
        description="a batch also stops growing at about this much estimated device work (bytes to move, "
        "FLOPs to compute), so that big requests launch one by one and their copies overlap the previous "
        "launch's kernel; a request above it runs alone; 0: no such limit",
    )
    max_queue_delay_ms: float = Field(
        2.0, ge=0,
        description="while every worker is busy, the longest the oldest queued request waits "
        "to gather a batch",
    )
    max_queue_size: int = Field(1024, gt=0, description="requests held (queued or running) before new ones get 429")
    max_body_mb: float = Field(1024.0, gt=0, description="largest request body (HTTP) or message (gRPC), in MiB")
    pinned_body_mb: float = Field(
        4096.0, ge=0,
        description="on GPUs, request bodies of 1 MiB and more are read into page-locked buffers, so that "
        "their tensors go to the GPU without a copy into pinned memory first; the buffers (power-of-two "
        "sizes, kept for reuse, the free ones let go when idle for --memory-trim-idle-s) hold at most "
        "this many MiB; 0: never",
    )
    graph_max_kib: float = Field(
        1024.0, ge=0,
        description="on GPUs, an attention request whose inputs hold at most this many KiB and that comes "
        "alone (the server holds no other request, and none came in the last 0.25 ms) runs at once on the "
        "event loop as a replay of a CUDA graph captured for its shape (the first request of a shape has "
        "it captured, after its own launch): no batcher or worker-thread hand-offs, no kernel launch in "
        "Python; requests in bursts batch as usual; the same for a session step of one session that runs "
        "inline (--session-inline-rows): a graph of its append and paged attention; 0: never",
    )
    max_json_mb: float = Field(
        64.0,
        gt=0,
        description="largest JSON document (native JSON bodies, the JSON part of Open Inference Protocol "
        "requests), in MiB: parsing JSON numbers takes 15-30x their text in memory; large tensors go "
        "over safetensors or binary tensor data",
    )
    http_keep_alive_s: float = Field(
        75.0, gt=0,
        description="how long an idle HTTP keep-alive connection stays open; longer than the idle timeout of "
        "the clients and load balancers in front (60 s is common), so that a client never sends a request "
        "on a connection the server is closing",
    )
    max_header_kb: float = Field(
        64.0, ge=1,
        description="largest HTTP request head (request line and header fields), in KiB: 431 past it, and "
        "the connection is closed (httptools holds an unfinished header field in memory)",
    )
    # lower bounds: a head smaller than a health probe's, or a client's usual headers, refuses every request
    max_headers: int = Field(100, ge=16, description="most header fields in one HTTP request (431 past it)")
    max_url_kb: float = Field(
        16.0, ge=1, lt=64, description="longest HTTP request URL, in KiB (414 past it; httptools parses "
        "no URL of 64 KiB or more)",
    )
    header_timeout_s: float = Field(
        30.0, gt=0,
        description="an HTTP request head (request line and headers) must arrive whole within this many "
        "seconds of its first byte (of the connection, for its first request): 408 and the connection "
        "closed otherwise",
    )
    body_timeout_s: float = Field(
        60.0, gt=0,
        description="an HTTP request body that stops arriving for this many seconds is dropped: 408 and "
        "the connection closed",
    )
    request_timeout_ms: float = Field(
        60000.0, gt=0,
        description="default deadline of a request; X-Request-Timeout-Ms or a gRPC deadline overrides it",
    )
    api_key: str | None = Field(
        None,
        description="if set, every call except health probes needs "
        "'Authorization: Bearer KEY' or 'X-API-Key' (surrounding whitespace is not part of the key; "
        "empty: no key)",
    )
    warmup_shapes: str = Field(
        "1x8x128x64,1x8x1024x64,1x32x1024x128,1x32x4096x128",
        description="shapes BxHxNxD compiled and autotuned per worker at start-up (comma-separated; each also "
        "warms causal and decode, and its power-of-two bucket of N): list the shapes you serve, since "
        "others run a default kernel config unless --autotune-new-shapes",
    )
    warmup_dtypes: str = Field("float16,bfloat16", description="dtypes warmed at start-up on GPUs")
    precompile: Literal["processes", "threads", "off"] = Field(
        "processes",
        description="on GPUs, before the warm-up: record which Triton kernel variants it compiles (every "
        "autotune config included) and compile those not in Triton's cache dir in parallel, in worker "
        "processes or threads (kernels/precompile.py), so that the warm-up finds them compiled; readiness "
        "still waits for the warm-up itself; off: the warm-up compiles them one by one",
    )
    precompile_workers: int = Field(
        0, ge=0, description="processes or threads --precompile compiles on; 0: one per CPU core the server "
        "may use (its affinity and cgroup CPU quota), at most one per GiB of available memory and 32",
    )
    autotune_cache: bool = Field(
        True,
        description="keep the autotuner's choices in Triton's cache dir (TRITON_CACHE_DIR/attnserve-autotune, "
        "keyed by kernel, autotuning key, GPU model and Triton version), so that a restart replays them instead "
        "of timing every config again (docs/deploy.md#the-triton-cache-volume); off: every start tunes anew",
    )
    memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of a GPU's memory a worker may plan to use; bigger requests are refused (413)",
    )
    autotune_new_shapes: bool = Field(
        False,
        description="autotune kernel block sizes for shapes first seen while serving (each new shape then "
        "blocks its worker for seconds); off: shapes outside --warmup-shapes run a default config",
    )
    memory_trim_idle_s: float = Field(
        10.0, ge=0,
        description="after this many seconds without requests, hand the memory kept from big request "
        "bodies back to the OS (kept while requests come, for reuse: see --max-body-mb), and the free "
        "blocks torch keeps cached on each GPU (an ended session's KV pages) back to the card; 0 keeps them "
        "(else at least 0.1: the check runs this often)",
    )
    tune_allocator: bool = Field(
        True,
        description="tune glibc's malloc for big request bodies (service/allocator.py): freed blocks up to "
        "--max-body-mb (at most 1 GiB) are kept for reuse, every thread allocates from one arena, and the "
        "heap is trimmed after --memory-trim-idle-s without requests; off: glibc's defaults, no trimming",
    )
    patch_uvicorn: bool = Field(
        True,
        description="read HTTP request bodies through service/http/uvicorn_patch.py: a big body goes from "
        "the socket into one buffer and to the app without another copy (only on the uvicorn version the "
        "patch was written for); off: uvicorn's own httptools protocol",
    )
    uvloop: bool = Field(
        True,
        description="run the event loop (HTTP and gRPC) on uvloop: less of each call's time in the loop "
        "itself; off, or without uvloop installed: asyncio's own loop",
    )
    gil_switch_interval_ms: float = Field(
        0.5, gt=0,
        description="Python's thread switch interval: the event loop and the worker threads hand the GIL "
        "to each other per batch, and the interpreter's 5 ms default adds up to that much per hand-off",
    )
    kv_cache_mb: float | None = Field(
        None, gt=0,
        description="size of each worker's paged KV cache for sessions (docs/api.md#sessions), in MiB; default: 256 on "
        "the CPU, on a GPU half of what the worker may use after its warm-up (--memory-fraction), the rest "
        "left to stateless requests",
    )
    kv_page_tokens: int = Field(64, ge=1, description="tokens per page of the sessions' KV cache")
    session_idle_s: float = Field(600.0, gt=0, description="a session without a step for this long is released")
    max_sessions: int = Field(4096, ge=1,
                              description="sessions held at once by each server process (a create beyond it gets 507)")
    session_inline_rows: int = Field(
        64, ge=0,
        description="a session step of at most this many query rows that comes alone (its worker idle, "
        "no other step queued, none accepted in the last 0.25 ms) runs at once on the event loop, which "
        "waits for the device: no hand-offs to the worker's threads; steps in bursts batch as usual; on the CPU "
        "only short ones (2**23 multiply-adds); 0: never",
    )
    log_level: str = Field("info", description=f"logging level: {', '.join(LOG_LEVELS)}")
    access_log: bool = Field(
        False,
        description="log one line per HTTP request (uvicorn's access log); off by default, like Triton "
        "Inference Server's: each line costs the event loop time on every call, and /metrics counts "
        "requests by route and status",
    )

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = {"warn": "warning", "fatal": "critical"}.get(value.strip().lower(), value.strip().lower())
        if level not in LOG_LEVELS:
            raise ValueError(f"unknown logging level {value!r}; choose {', '.join(LOG_LEVELS)}")
        return level

    @field_validator("layer_dtype")
    @classmethod
    def _layer_dtype(cls, value: str | None) -> str | None:
        """Checked with or without a --layer (a value no layer could take is a mistake either way)."""
        if value and value not in LAYER_DTYPES:
            raise ValueError(f"{value!r} is not a layer dtype; choose one of {', '.join(LAYER_DTYPES)}")
        return value

    @field_validator("api_key")
    @classmethod
    def _stripped_key(cls, value: str | None) -> str | None:
        """A key read from a file or a secret often ends in a newline no client sends. A key of only
        whitespace (an empty key file, an unset secret) is refused: taken as "no key" it would
        serve without one and say nothing; "" says that on purpose."""
        if value is None:
            return None
        if value and not value.strip():
            raise ValueError("is only whitespace (an empty key file or secret?): give the key, or '' to serve "
                             "without one")
        return value.strip()

    @field_validator("memory_trim_idle_s")
    @classmethod
    def _trim_period(cls, value: float) -> float:
        if 0 < value < 0.1:
            raise ValueError(f"must be 0 (off) or at least 0.1 seconds, got {value:g}")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> Settings:
        if self.grpc_port and self.grpc_port == self.http_port and self.http_fd is None:
            raise ValueError(f"--http-port and --grpc-port are both {self.http_port}; give them different ports")
        return self

    @field_validator("layer", mode="before")
    @classmethod
    def _layer_list(cls, value: Any) -> Any:
        """ATTNSERVE_LAYER: 'a=/m:0' or 'a=/m:0,b=/m:3', or a JSON list of such specs."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError:
                raise ValueError(f"not a JSON list of NAME=DIR:INDEX specs: {value!r}") from None
        return [part.strip() for part in text.split(",") if part.strip()]

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def pinned_body_bytes(self) -> int:
        return int(self.pinned_body_mb * 1024 * 1024)

    @property
    def max_json_bytes(self) -> int:
        return min(self.max_body_bytes, int(self.max_json_mb * 1024 * 1024))


# ATTNSERVE_* variables that are no option: switches the kernels read at import (kernels/launch.py,
# hopper_bwd.py, mkl_vml.py)
KERNEL_VARIABLES = frozenset({"ATTNSERVE_AUTOTUNE", "ATTNSERVE_BWD_DETERMINISTIC", "ATTNSERVE_DIRECT_LAUNCH",
                              "ATTNSERVE_VML_WARMUP"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per ATTNSERVE_* variable that nothing reads (a misspelt option is ignored otherwise),
    with the nearest option's variable."""
    known = {f"ATTNSERVE_{name.upper()}" for name in Settings.model_fields} | KERNEL_VARIABLES
    lines = []
    for var in sorted(v for v in environ if v.startswith("ATTNSERVE_") and v not in known):
        near = difflib.get_close_matches(var.removeprefix("ATTNSERVE_"), sorted(k[10:] for k in known), n=1)
        lines.append(f"{var} is no attnserve option: ignored"
                     + (f" (did you mean ATTNSERVE_{near[0]}?)" if near else ""))
    return lines


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _OneLineErrors(argparse.ArgumentParser):
    """A usage error is one line and exit code 2 (argparse prints the whole usage block first:
    dozens of lines above the one that says what is wrong)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per ``Settings`` field; every default comes from Settings."""
    parser = _OneLineErrors(
        prog="python -m service",
        description="attnserve: exact attention served over HTTP (FastAPI) and gRPC. "
        "Every option also reads an ATTNSERVE_<NAME> environment variable (e.g. ATTNSERVE_HTTP_PORT).",
    )
    for name, field in Settings.model_fields.items():
        env = f"ATTNSERVE_{name.upper()}"
        help_text = (
            f"{field.description} [env {env}; default {field.get_default(call_default_factory=True)!r}]"
        )
        if name == "layer":
            parser.add_argument(
                _flag(name), action="append", default=None, metavar="NAME=DIR:INDEX", help=help_text
            )
        elif field.annotation is bool:
            parser.add_argument(
                _flag(name), action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(_flag(name), default=None, help=help_text)
    return parser


def load_settings(argv: Sequence[str] | None = None, **overrides: Any) -> Settings:
    """Parse ``argv`` (flags win over ATTNSERVE_* variables) and build the one Settings object."""
    args = vars(build_parser().parse_args(argv if argv is not None else []))
    given = {k: v for k, v in args.items() if v is not None}
    given.update(overrides)
    return Settings(**given)
