import sys

from embedserv.cli import main

sys.exit(main())
