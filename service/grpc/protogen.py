"""Generate the gRPC stubs from ``proto/`` and load them: ``make proto`` = ``python -m service.grpc.protogen``.

The stubs are build output (git-ignored ``proto/gen/``), never edited by hand. They are produced by
``grpc_tools.protoc`` (grpcio-tools, pinned to the grpcio runtime's version) from

    proto/attention/v1/attention.proto      package attention.v1  (docs/api.md#grpc)
    proto/inference/grpc_predict_v2.proto   package inference     (docs/api.md#open-inference-protocol)

``proto/gen/STAMP.json`` records what they were generated from (a hash of each .proto and the
grpcio-tools version). ``attention_stubs()`` / ``inference_stubs()`` check it on first use and
regenerate stale or missing stubs (or fail with a message that says to run ``make proto``), then
import them with ``proto/gen`` on ``sys.path`` (protoc's imports are absolute: ``attention.v1``,
``inference``).

Keep ``inference_stubs()`` out of a process that also imports ``tritonclient.grpc``: both define
the ``inference.*`` messages in protobuf's one default descriptor pool, which refuses the second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger("attnserve.protogen")

ROOT = Path(__file__).resolve().parents[2]  # the repository: proto/ lies beside service/
PROTO_DIR = ROOT / "proto"
GEN_DIR = PROTO_DIR / "gen"
STAMP = GEN_DIR / "STAMP.json"
PROTOS = ("attention/v1/attention.proto", "inference/grpc_predict_v2.proto")


def _tools_version() -> str | None:
    try:
        from grpc_tools import grpc_version
    except ImportError:  # a runtime-only install: stubs must have been generated at build time
        return None
    return grpc_version.VERSION


def _fingerprint() -> dict:
    """What the stubs depend on: each .proto's bytes and the generator's version."""
    return {
        "protos": {rel: hashlib.sha256((PROTO_DIR / rel).read_bytes()).hexdigest() for rel in PROTOS},
        "grpcio_tools": _tools_version(),
    }


def _read_stamp() -> dict | None:
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None


def is_fresh() -> bool:
    """True when proto/gen holds stubs of the current .proto files from the installed grpcio-tools."""
    stamp, want = _read_stamp(), _fingerprint()
    if stamp is None or stamp.get("protos") != want["protos"]:
        return False
    return want["grpcio_tools"] is None or stamp.get("grpcio_tools") == want["grpcio_tools"]


@contextlib.contextmanager
def _lock():
    """One generator at a time across processes (pytest and the server it starts may race)."""
    GEN_DIR.mkdir(parents=True, exist_ok=True)
    with open(GEN_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def generate(force: bool = False) -> bool:
    """Run grpc_tools.protoc over PROTOS into proto/gen; returns whether it generated anything."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError("grpcio-tools is not installed; `make install` installs it") from None
    import importlib.resources

    with _lock():
        if not force and is_fresh():
            return False
        STAMP.unlink(missing_ok=True)  # nobody trusts a half-written tree
        for child in GEN_DIR.iterdir():
            if child.name != ".lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        well_known = str(importlib.resources.files("grpc_tools") / "_proto")
        args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={GEN_DIR}",
                f"--pyi_out={GEN_DIR}", f"--grpc_python_out={GEN_DIR}", *(str(PROTO_DIR / p) for p in PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} (see the messages above)")
        STAMP.write_text(json.dumps(_fingerprint(), indent=2) + "\n")
    log.info("generated gRPC stubs in %s", GEN_DIR)
    return True


def ensure_stubs() -> None:
    """Make sure proto/gen is fresh (regenerating it if needed) and on sys.path."""
    if not is_fresh():
        try:
            generate()
        except Exception as exc:
            raise RuntimeError(
                f"the gRPC stubs in {GEN_DIR} are missing or older than proto/ and could not be "
                f"regenerated ({exc}); run `make proto` (python -m service.grpc.protogen)"
            ) from exc
    _check_runtime()
    if str(GEN_DIR) not in sys.path:
        sys.path.insert(0, str(GEN_DIR))


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def _check_runtime() -> None:
    """The grpcio runtime must not be older than the grpcio-tools that generated the stubs."""
    import grpc

    generated_by = (_read_stamp() or {}).get("grpcio_tools")
    if not generated_by or generated_by == grpc.__version__:
        return
    if _version_tuple(grpc.__version__) < _version_tuple(generated_by):
        raise RuntimeError(
            f"grpcio {grpc.__version__} is older than grpcio-tools {generated_by}, which generated the "
            f"stubs in {GEN_DIR}; install grpcio=={generated_by}, or regenerate with a grpcio-tools that "
            f"matches the runtime (pip install grpcio-tools=={grpc.__version__}; make proto)"
        )
    log.warning("grpcio runtime %s differs from grpcio-tools %s that generated the stubs; pin them equal",
                grpc.__version__, generated_by)


def _load(*modules: str) -> SimpleNamespace:
    ensure_stubs()
    return SimpleNamespace(**{m.rsplit(".", 1)[1]: importlib.import_module(m) for m in modules})


def attention_stubs() -> SimpleNamespace:
    """``.attention_pb2`` and ``.attention_pb2_grpc`` of package attention.v1."""
    return _load("attention.v1.attention_pb2", "attention.v1.attention_pb2_grpc")


def inference_stubs() -> SimpleNamespace:
    """``.grpc_predict_v2_pb2`` and ``.grpc_predict_v2_pb2_grpc`` of package inference (OIP)."""
    return _load("inference.grpc_predict_v2_pb2", "inference.grpc_predict_v2_pb2_grpc")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    force = "--if-stale" not in sys.argv  # make proto: always regenerate
    generate(force=force)
    _check_runtime()
    print(f"gRPC stubs in {GEN_DIR} are up to date ({', '.join(PROTOS)})")
