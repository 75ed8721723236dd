import sys

from parallax_ps.server import main

sys.exit(main())
