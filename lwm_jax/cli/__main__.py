"""`python -m lwm_jax.cli ...` runs the `lwm-jax` console script."""
import sys

from lwm_jax.cli import main

sys.exit(main())
