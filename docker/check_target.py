"""Run by the Dockerfile's builder on the venv that ships: does it hold the torch its TARGET promises?

    python check_target.py gateway|cpu|cuda

gateway: no torch at all (the gateway and the autoscaler never import it). cpu: a torch built without CUDA.
cuda: a torch built with CUDA (it needs no GPU to import). Exit 1 with the reason otherwise, so that a
dependency that swaps torch for another build fails the image build instead of shipping.
"""

from __future__ import annotations

import importlib.util
import sys


def torch_build() -> tuple[str | None, str | None]:
    """(torch version, CUDA version it was built for): (None, None) without torch, (v, None) for a CPU build."""
    if importlib.util.find_spec("torch") is None:
        return None, None
    import torch

    return torch.__version__, torch.version.cuda


def problem(target: str, version: str | None, cuda: str | None) -> str | None:
    if target == "gateway":
        return None if version is None else f"torch {version} is installed; the gateway target has none"
    if version is None:
        return f"no torch is installed; the {target} target needs one"
    if target == "cpu":
        return None if cuda is None else f"torch {version} is a CUDA {cuda} build; the cpu target wants the CPU build"
    if target == "cuda":
        return None if cuda is not None else f"torch {version} is a CPU build; the cuda target wants a CUDA build"
    return f"unknown target {target!r}: gateway, cpu or cuda"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    version, cuda = torch_build()
    print(f"target {argv[0]}: torch {version or 'absent'}, CUDA {cuda or 'none'}")
    reason = problem(argv[0], version, cuda)
    if reason:
        print(f"check_target: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
