"""`python -m nanovllm ...` is the same as the `nanovllm` command."""
import sys

from nanovllm.entrypoints.cli import main

sys.exit(main())
