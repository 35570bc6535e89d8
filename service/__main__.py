"""``python -m service --help`` lists every option; each also reads an ATTNSERVE_* variable.

The options are read before the server's modules are imported, so that a serving process can open
its GPUs (``open_devices_early``) while the rest of the service imports.
"""

import sys
import threading

from pydantic import ValidationError

from service.settings import Settings, build_parser, load_settings


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


if __name__ == "__main__":
    try:
        settings = load_settings(sys.argv[1:])
    except ValidationError as exc:  # a usage error, not a traceback
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        build_parser().error(problems)
    if settings.device.strip().lower() != "cpu":
        open_devices_early(settings)
    from service.server import main

    main(settings, sys.argv[1:])
