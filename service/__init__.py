"""attnserve: exact attention served over HTTP and gRPC (docs/api.md).

``__version__`` is the installed package's version (pyproject.toml), read once here; every
transport reports this one.
"""

from importlib import metadata

try:
    __version__ = metadata.version("attnserve")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare source tree
    __version__ = "0.0.0"
