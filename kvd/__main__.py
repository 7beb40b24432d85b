import sys

from kvd.cli import main

sys.exit(main())
