"""Container health check: exit 0 when GET /readyz answers 200, else 1.

Used by the Dockerfile's HEALTHCHECK (and usable as a Kubernetes exec probe). Standard library only,
so it runs in the slim image without curl. The port comes from ATTNSERVE_HTTP_PORT (default 8000);
/readyz is open even when ATTNSERVE_API_KEY is set (health probes need no key).

    python docker/healthcheck.py [PATH]     # PATH defaults to /readyz; /healthz checks liveness
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def check(path: str = "/readyz", timeout: float = 4.0) -> bool:
    port = int(os.environ.get("ATTNSERVE_HTTP_PORT", "8000"))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(0 if check(sys.argv[1] if len(sys.argv) > 1 else "/readyz") else 1)
