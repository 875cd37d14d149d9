"""``python -m trainer warmup ...`` (same as ``tlt-train``)."""

import sys

from trainer.cli import main

sys.exit(main())
