"""`python -m parallax ...`: the `parallax` command (parallax.cli), for an environment whose
scripts directory is not on PATH."""
import sys

from parallax.cli import main

sys.exit(main())
