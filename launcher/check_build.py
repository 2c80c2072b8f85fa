"""``hvdlike-run --check-build``: which frameworks, controllers, data planes and engines work here.

Frameworks and Ray are looked up without importing them (importing jax,
TensorFlow or Ray is slow): a package counts when it is installed, Ray Train
when every package of Ray's ``train`` extra is. torch is imported because the
data plane lives in it. ``mpirun --version`` tells Open MPI from MPICH (the one
on PATH is used). Each engine line says why it is or is not available.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
from typing import List, Optional, Tuple


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


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing_extra(dist: str, extra: str) -> List[str]:
    """Packages of ``dist``'s ``extra`` that are not installed."""
    missing = []
    for requirement in importlib.metadata.requires(dist) or []:
        if f'extra == "{extra}"' not in requirement.replace("'", '"'):
            continue
        name = re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]
        if name and name != dist and _version(name) is None:
            missing.append(name)
    return missing


def _engine(name: str, ok: bool, why: str) -> Tuple[str, bool]:
    return (f"{name} ({why})" if why else name), ok


def engines(gloo: bool, mpi4py: bool, flavour: Optional[str]) -> List[Tuple[str, bool]]:
    """Each engine hvdlike runs on or under, available or not, with the reason."""
    from hvdlike.core import config as knobs

    found = []
    ssh = shutil.which("ssh")
    found.append(_engine("ssh", ssh is not None, ssh or "no ssh client on PATH"))
    found.append(_engine("Gloo", gloo, "torch.distributed" if gloo
                         else "torch.distributed without Gloo"))
    try:
        shm_on = knobs.load(os.environ).shm
    except Exception:  # noqa: BLE001 - a malformed HVDLIKE_SHM: the runtime refuses it
        shm_on = False
    shm_dir = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    found.append(_engine("shared memory", shm_on and shm_dir,
                         "HVDLIKE_SHM is off" if not shm_on else
                         "/dev/shm" if shm_dir else "no writable /dev/shm"))
    mpirun = shutil.which("mpirun")
    for engine, title in (("mpich", "MPICH"), ("openmpi", "Open MPI")):
        if not mpi4py:
            why = "mpi4py not installed"
        elif mpirun is None:
            why = "no mpirun on PATH"
        elif flavour != engine:
            other = {"mpich": "MPICH", "openmpi": "Open MPI"}.get(flavour, "unrecognised")
            why = f"the mpirun on PATH is {other}"
        else:
            why = mpirun
        found.append(_engine(title, mpi4py and flavour == engine, why))
    srun = shutil.which("srun")
    where = "inside Slurm job " + os.environ["SLURM_JOB_ID"] if os.environ.get("SLURM_JOB_ID") \
        else "not inside an allocation"
    found.append(_engine("Slurm", srun is not None,
                         f"{srun}; {where}" if srun else "no srun on PATH"))
    ray = _version("ray")
    found.append(_engine("Ray", ray is not None, f"ray {ray}" if ray
                         else "pip install 'hvdlike[ray]'"))
    missing = _missing_extra("ray", "train") if ray else ["ray"]
    found.append(_engine("Ray Train", ray is not None and not missing,
                         "ray[train]" if not missing else
                         f"missing {', '.join(missing)}: pip install 'hvdlike[ray-train]'"))
    torchrun = shutil.which("torchrun")
    found.append(_engine("torchrun", torchrun is not None, torchrun or "no torchrun on PATH"))
    return found


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
        ("Available Engines", engines(gloo, _has("mpi4py"), flavour)),
    ]


def report(version: str) -> str:
    """The ``--check-build`` text."""
    lines = [f"hvdlike v{version}:", ""]
    for title, entries in probe():
        lines.append(f"{title}:")
        lines.extend(f"    {_mark(ok)} {name}" for name, ok in entries)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
