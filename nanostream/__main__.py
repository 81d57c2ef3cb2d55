import sys

from nanostream.cli import main

sys.exit(main())
