import sys

from edgeinfer.cli.main import main

sys.exit(main())
