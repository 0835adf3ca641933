import sys

from ssdtrain.cli import main

sys.exit(main())
