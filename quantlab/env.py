"""Where we run: device, dtype, library versions, git commit. Recorded in every manifest."""
from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from dataclasses import dataclass
from pathlib import Path

from quantlab.errors import QuantlabError

LIBRARIES = ("torch", "transformers", "nvidia-modelopt", "tensorrt_llm", "quantlab")


@functools.cache
def versions() -> dict[str, str | None]:
    """Versions of the libraries whose outputs enter cache keys (None for one not installed)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.cache
def git_commit() -> str | None:
    """The commit of the quantlab checkout, or None (not a checkout, or no git)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


@dataclass(frozen=True)
class Device:
    """Where the run computes: type, index, name, architecture and (CUDA) compute capability."""
    type: str  # cpu | cuda
    index: int | None
    name: str
    capability: tuple[int, int] | None  # CUDA compute capability

    @property
    def torch(self) -> str:
        """The torch device string (cpu, cuda, cuda:N)."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def arch(self) -> str:
        """What numerics depend on: 'cpu' or 'sm_90' etc."""
        return "cpu" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 GEMMs (compute capability 8.9 or newer)."""
        return self.capability is not None and self.capability >= (8, 9)

    def describe(self) -> dict:
        """Type, name and architecture, for records."""
        return {"type": self.type, "name": self.name, "arch": self.arch}


def resolve_device(spec: str) -> Device:
    """model.device -> a Device (auto: the first CUDA GPU, else the CPU); exit 2 for one that does not exist."""
    import torch

    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        import platform

        return Device("cpu", None, platform.processor() or platform.machine(), None)
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise QuantlabError(f"model.device={spec} but no CUDA GPU is visible", fix="use model.device=cpu (or auto)")
        index = int(spec.split(":")[1]) if ":" in spec else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise QuantlabError(f"model.device={spec}: only {torch.cuda.device_count()} GPU(s) visible")
        return Device("cuda", index, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    raise QuantlabError(f"model.device={spec!r} is not a device", fix="use auto, cpu, cuda or cuda:N")


def resolve_dtype(spec: str, device: Device):
    """model.dtype -> a torch dtype (auto: bfloat16 on a GPU, float32 on a CPU)."""
    import torch

    if spec == "auto":
        # bf16 matmul on CPUs without AMX/AVX512-BF16 runs hundreds of times slower than fp32.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if spec not in table:
        raise QuantlabError(f"model.dtype={spec!r} is not supported", fix="use auto, float32, bfloat16 or float16")
    return table[spec]
