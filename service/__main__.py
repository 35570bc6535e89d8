"""``python -m service --help`` lists every option; each also reads an ATTNSERVE_* variable.

The options are read before the server's modules are imported, so that a serving process can open
its GPUs (``open_devices_early``) while the rest of the service imports.
"""

import contextlib
import os
import signal
import sys
import threading

from pydantic import ValidationError

from service.settings import Settings, build_parser, load_settings, unknown_variables


def open_devices_early(settings: Settings) -> threading.Thread:
    """Create the CUDA context of each GPU this process will serve, on a daemon thread: the context
    (about a second a GPU) is made while the main thread imports the HTTP and gRPC stacks and binds
    the ports, instead of after them in the worker's start. A supervisor of ``--processes`` opens
    none (its children do); any failure is left for the worker's own start to report."""

    def run() -> None:
        try:
            import torch

            from service.core.devices import resolve_devices
            from service.processes import process_count

            if settings.http_fd is None and process_count(settings) > 1:
                return
            for device in resolve_devices(settings.device):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # makes the device's primary context
        except Exception:  # noqa: BLE001 - the worker's start opens the device again and says what fails
            return

    thread = threading.Thread(target=run, name="attnserve-open-devices", daemon=True)
    thread.start()
    return thread


def die_with_supervisor() -> None:
    """A process of ``--processes`` gets SIGTERM (and drains) when its supervisor dies, even by
    SIGKILL: left running it would keep serving the ports, and a restart could not bind them."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def quiet_interrupt(signum, frame) -> None:
    """Ctrl-C before the server installs its own handlers (imports, loading layers): exit 130
    without a traceback; the server's handlers replace this one once it runs."""
    sys.stderr.write("interrupted while starting\n")
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, quiet_interrupt)
    try:
        settings = load_settings(sys.argv[1:])
    except ValidationError as exc:  # a usage error, not a traceback
        problems = "; ".join(  # (an error of several options together has no option of its own)
            (f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ") for e in exc.errors()
        )
        build_parser().error(problems)
    if settings.peers is not None:
        die_with_supervisor()
    elif settings.http_fd is None:  # (a --processes child: its supervisor said it already)
        for line in unknown_variables(os.environ):
            sys.stderr.write(f"warning: {line}\n")
    if settings.device.strip().lower() != "cpu":
        open_devices_early(settings)
    from service.server import main

    main(settings, sys.argv[1:])
