"""`python -m nanovllm ...` is the same as the `nanovllm` command."""
from nanovllm.entrypoints.cli import run

run()
