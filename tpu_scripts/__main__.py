"""`python -m tpu_scripts COMMAND ...` (see tpu_scripts/cli.py and docs/tpu.md)."""
import sys

from tpu_scripts.cli import main

sys.exit(main())
