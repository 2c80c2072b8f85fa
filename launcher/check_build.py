"""``hvdlike-run --check-build``: which frameworks, controllers and data planes work here.

Frameworks and Ray are looked up without importing them (importing jax,
TensorFlow or Ray is slow); torch is imported because the data plane lives in
it. ``mpirun --version`` tells Open MPI from MPICH (the one on PATH is used).
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


def _mpirun_flavour():
    """Which MPI the ``mpirun`` on PATH belongs to (None: unknown or not answering)."""
    from .errors import LaunchError
    from .mpi_exec import detect_flavour

    try:
        return detect_flavour("mpirun")
    except LaunchError:
        return None


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
    flavour = _mpirun_flavour() if shutil.which("mpirun") else None
    return [
        ("Available Frameworks", [
            ("PyTorch", torch_ok), ("NumPy", _has("numpy")), ("JAX", _has("jax")),
            ("TensorFlow/Keras", _has("tensorflow") or _has("keras")),
        ]),
        ("Available Controllers", [("Gloo", gloo), ("MPI", mpi)]),
        ("Available Tensor Operations", [("NCCL", nccl), ("Gloo", gloo), ("MPI", mpi)]),
        ("Available Launchers", [
            ("ssh", shutil.which("ssh") is not None),
            ("mpirun (Open MPI)", mpi and flavour == "openmpi"),
            ("mpirun (MPICH)", mpi and flavour == "mpich"),
            ("srun (Slurm)", shutil.which("srun") is not None),
            ("torchrun", shutil.which("torchrun") is not None),
            ("Ray (hvdlike.ray)", _has("ray")),
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
