"""``hvdlike-run --check-build``: which frameworks, controllers and data planes work here.

Frameworks are looked up without importing them (importing jax or TensorFlow
is slow); torch is imported because the data plane lives in it.
"""

from __future__ import annotations

import importlib.util
import shutil
from typing import List, Tuple


def _mark(ok: bool) -> str:
    return "[X]" if ok else "[ ]"


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def probe() -> List[Tuple[str, List[Tuple[str, bool]]]]:
    """Sections of ``(name, available)`` pairs."""
    gloo = nccl = torch_ok = False
    try:
        import torch
        import torch.distributed as dist

        torch_ok = dist.is_available()
        gloo = torch_ok and dist.is_gloo_available()
        nccl = torch_ok and dist.is_nccl_available() and torch.cuda.is_available()
    except ImportError:
        pass
    mpi = _has("mpi4py") and (shutil.which("mpirun") or shutil.which("mpiexec")) is not None
    return [
        ("Available Frameworks", [
            ("PyTorch", torch_ok), ("NumPy", _has("numpy")), ("JAX", _has("jax")),
            ("TensorFlow/Keras", _has("tensorflow") or _has("keras")),
        ]),
        ("Available Controllers", [("Gloo", gloo), ("MPI", mpi)]),
        ("Available Tensor Operations", [("NCCL", nccl), ("Gloo", gloo), ("MPI", mpi)]),
        ("Available Launchers", [
            ("ssh", shutil.which("ssh") is not None), ("mpirun", mpi),
            ("srun", shutil.which("srun") is not None),
            ("torchrun", shutil.which("torchrun") is not None),
        ]),
    ]


def report(version: str) -> str:
    """The ``--check-build`` text."""
    lines = [f"hvdlike v{version}:", ""]
    for title, entries in probe():
        lines.append(f"{title}:")
        lines.extend(f"    {_mark(ok)} {name}" for name, ok in entries)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
