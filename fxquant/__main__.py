import sys

from fxquant.cli import main

sys.exit(main())
