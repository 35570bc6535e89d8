"""One Settings object: flags > ATTNSERVE_* variables > defaults; --help documents every option."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from service.settings import Settings, build_parser, load_settings


def test_defaults_match_the_contract(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(f"ATTNSERVE_{name.upper()}", raising=False)
    s = load_settings([])
    assert (s.http_port, s.grpc_port, s.device, s.max_queue_size) == (8000, 8001, "auto", 1024)
    assert s.batching is True and s.max_body_mb >= 1024


def test_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("ATTNSERVE_MAX_QUEUE_DELAY_MS", "7.5")
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_TOKENS", "111")
    s = load_settings(["--max-batch-tokens", "222"])
    assert s.max_queue_delay_ms == 7.5 and s.max_batch_tokens == 222


def test_bool_and_repeatable_flags(monkeypatch):
    monkeypatch.delenv("ATTNSERVE_BATCHING", raising=False)
    s = load_settings(["--no-batching", "--layer", "a=/m:0", "--layer", "b=/m:1"])
    assert s.batching is False and s.layer == ["a=/m:0", "b=/m:1"]
    monkeypatch.setenv("ATTNSERVE_BATCHING", "false")
    assert load_settings([]).batching is False
    assert load_settings(["--batching"]).batching is True
    # the variable: one spec, specs separated by commas, or a JSON list (a plain spec once failed to start
    # with a traceback from the settings library)
    for value, want in (("a=/m:0", ["a=/m:0"]), ("a=/m:0, b=/m:1", ["a=/m:0", "b=/m:1"]),
                        ('["a=/m:0", "b=/m:1"]', ["a=/m:0", "b=/m:1"])):
        monkeypatch.setenv("ATTNSERVE_LAYER", value)
        assert load_settings([]).layer == want
    monkeypatch.setenv("ATTNSERVE_LAYER", "[oops")
    with pytest.raises(ValueError, match="JSON list of NAME=DIR:INDEX"):
        load_settings([])


def test_bad_values_are_refused():
    with pytest.raises(ValueError):
        load_settings(["--max-queue-size", "lots"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--casual"])
    with pytest.raises(ValueError):
        load_settings(["--precompile", "fork"])  # processes, threads or off
    with pytest.raises(ValueError):
        load_settings(["--precompile-workers", "-1"])


def test_values_no_server_can_use_are_refused(monkeypatch):
    """Refused before any port is bound (each once started and failed later, or not at all)."""
    from service.core.devices import parse_shapes

    for argv, match in ((["--max-body-mb", "inf"], "finite"), (["--kv-cache-mb", "nan"], "finite"),
                        (["--log-level", "verbose"], "logging level"),
                        (["--memory-trim-idle-s", "0.001"], "at least 0.1"),
                        (["--http-port", "9000", "--grpc-port", "9000"], "different ports"),
                        (["--api-key", " \n"], "only whitespace"),  # an empty key file: not an open server
                        (["--max-headers", "1"], "greater than or equal to 16"),  # no request could pass
                        (["--max-header-kb", "0.01"], "greater than or equal to 1"),
                        (["--max-url-kb", "0.01"], "greater than or equal to 1"),
                        (["--layer-dtype", "float64"], "not a layer dtype")):  # with or without a --layer
        with pytest.raises(ValueError, match=match):
            load_settings(argv)
    with pytest.raises(ValueError, match="head dim 257 is over 256"):
        parse_shapes("1x8x128x64,1x1x1x257")
    assert load_settings(["--log-level", "WARN"]).log_level == "warning"
    assert load_settings(["--http-port", "9000", "--grpc-port", "0"]).grpc_port == 0  # gRPC off
    monkeypatch.setenv("ATTNSERVE_API_KEY", "s3cret\n")  # a key file's newline is not part of the key
    assert load_settings([]).api_key == "s3cret"
    assert load_settings(["--api-key", ""]).api_key == ""  # no key, on purpose


def test_the_layer_dtypes_are_the_wire_dtypes():
    from service.settings import LAYER_DTYPES
    from service.wire.tensors import FLOAT_DTYPES

    assert LAYER_DTYPES == tuple(FLOAT_DTYPES)


def test_a_usage_error_is_one_line():
    for argv in (["--http-port", "0"], ["--no-such-option"]):
        out = subprocess.run([sys.executable, "-m", "service", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("python -m service: error: ") and "--help" in out.stderr


def test_start_up_options(monkeypatch):
    for name in ("PRECOMPILE", "PRECOMPILE_WORKERS", "AUTOTUNE_CACHE"):
        monkeypatch.delenv(f"ATTNSERVE_{name}", raising=False)
    s = load_settings([])
    assert (s.precompile, s.precompile_workers, s.autotune_cache) == ("processes", 0, True)
    monkeypatch.setenv("ATTNSERVE_PRECOMPILE", "off")
    s = load_settings(["--precompile-workers", "4", "--no-autotune-cache"])
    assert (s.precompile, s.precompile_workers, s.autotune_cache) == ("off", 4, False)
    assert load_settings(["--precompile", "threads"]).precompile == "threads"


def test_help_documents_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "service", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert f"ATTNSERVE_{name.upper()}" in text
        assert field.description and " ".join(field.description.split())[:30] in text


def test_the_api_docs_table_lists_every_option():
    """docs/api.md's command-line table: every option with its flag and its variable (the session
    options were once only in the Sessions section, without their variables)."""
    text = (ROOT / "docs" / "api.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    for name in Settings.model_fields:
        flag, env = "`--" + name.replace("_", "-") + "`", f"`ATTNSERVE_{name.upper()}`"
        assert any(flag in row and env in row for row in rows), f"{flag} / {env}"


def test_variables_nothing_reads_are_named_at_start(tmp_path):
    """A misspelt ATTNSERVE_* variable was ignored in silence: the server names it (and the nearest
    option) on stderr; the kernels' own switches are known."""
    from service.settings import unknown_variables

    env = {"ATTNSERVE_MAX_QUEUE": "5", "ATTNSERVE_AUTOTUNE": "0", "ATTNSERVE_HTTP_PORT": "1", "PATH": "/bin"}
    assert unknown_variables(env) == [
        "ATTNSERVE_MAX_QUEUE is no attnserve option: ignored (did you mean ATTNSERVE_MAX_QUEUE_SIZE?)"]
    out = subprocess.run([sys.executable, "-m", "service", "--device", "tpu:0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "ATTNSERVE_KV_CACHE_MBS": "64"})
    assert out.returncode == 2
    assert "warning: ATTNSERVE_KV_CACHE_MBS is no attnserve option: ignored (did you mean " \
           "ATTNSERVE_KV_CACHE_MB?)" in out.stderr, out.stderr
