import sys

from specdec.cli.main import main

sys.exit(main())
