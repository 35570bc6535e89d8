"""``python -m service --help`` lists every option; each also reads an ATTNSERVE_* variable."""

import sys

from pydantic import ValidationError

from service.server import main
from service.settings import build_parser, load_settings

if __name__ == "__main__":
    try:
        settings = load_settings(sys.argv[1:])
    except ValidationError as exc:  # a usage error, not a traceback
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}" for e in exc.errors()
        )
        build_parser().error(problems)
    main(settings, sys.argv[1:])
