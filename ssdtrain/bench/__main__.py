"""``python -m ssdtrain.bench``: the same as ``ssdtrain bench``."""

import sys

from ssdtrain.bench.command import main

sys.exit(main())
