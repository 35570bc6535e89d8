"""``python -m service --help`` lists every option; each also reads an ATTNSERVE_* variable."""

import sys

from .server import main
from .settings import load_settings

if __name__ == "__main__":
    main(load_settings(sys.argv[1:]))
