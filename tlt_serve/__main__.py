"""``python -m tlt_serve serve ...``: the same CLI as the ``tlt-serve`` console script."""

import sys

from tlt_serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
