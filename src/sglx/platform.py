"""One immutable snapshot of the machine: device, versions and every kernel package sglx can use.

Selection, `doctor` and error messages all read this snapshot instead of probing the machine
themselves, so tests can build a fake snapshot for any platform (H100, MI300, MPS, ...).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import platform as _pyplatform
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

DeviceKind = Literal["cuda", "rocm", "mps", "npu", "xpu", "cpu"]
DEVICE_KINDS: tuple[str, ...] = ("cuda", "rocm", "mps", "npu", "xpu", "cpu")


@dataclass(frozen=True)
class KernelPackage:
    """A kernel package sglx can use: its import name, its pip distribution and the extra that installs it."""

    module: str
    distributions: tuple[str, ...]
    install_hint: str


# Every optional kernel package that a backend may need. The install hint is what a user should run.
KERNEL_PACKAGES: tuple[KernelPackage, ...] = (
    KernelPackage("flashinfer", ("flashinfer-python", "flashinfer"), "pip install 'sglx[flashinfer]'"),
    KernelPackage("flash_attn", ("flash-attn", "flash_attn"), "pip install flash-attn for FlashAttention 2"),
    KernelPackage(
        "flash_attn_interface",
        ("flash-attn-3", "flash_attn_3", "flashattn-hopper"),
        "build FlashAttention 3 from flash-attention/hopper, or pip install sgl-kernel (its wheel is 535 MB)",
    ),
    KernelPackage(
        "flash_attn.cute",
        ("flash-attn-4", "flash-attn-cute", "flash_attn_cute", "flash-attn"),
        "pip install 'sglx[fa]' for FlashAttention 4; a CUDA 13 torch also needs 'nvidia-cutlass-dsl[cu13]'",
    ),
    KernelPackage("sageattention", ("sageattention",), "pip install 'sglx[sage]'"),
    KernelPackage(
        "sageattn3",
        ("sageattn3", "sageattention3"),
        "build SageAttention3 from thu-ml/SageAttention (sageattention3_blackwell)",
    ),
    KernelPackage("triton", ("triton", "pytorch-triton-rocm"), "pip install triton"),
    KernelPackage("diffusers", ("diffusers",), "pip install diffusers (a dependency of sglx: reinstall sglx)"),
    KernelPackage("st_attn", ("st_attn", "st-attn"), "pip install st_attn (Sliding Tile Attention kernels)"),
    KernelPackage("vsa", ("vsa",), "pip install vsa (Video Sparse Attention kernels)"),
    KernelPackage("svg", ("svg",), "install Sparse-VideoGen from github.com/svg-project/Sparse-VideoGen"),
    KernelPackage(
        "kernel.attn.vmoba_attn.vmoba",
        ("vmoba",),
        "install the VMoBA kernel (kernel.attn.vmoba_attn.vmoba)",
    ),
    KernelPackage("flash_mla", ("flash-mla", "flash_mla"), "install FlashMLA from github.com/deepseek-ai/FlashMLA"),
    KernelPackage("aiter", ("aiter", "amd-aiter"), "install AITER from github.com/ROCm/aiter"),
    KernelPackage("wave_lang", ("wave-lang", "wave_lang"), "pip install wave-lang"),
    KernelPackage("torch_npu", ("torch-npu", "torch_npu"), "install torch_npu from Ascend"),
    KernelPackage("sgl_kernel", ("sgl-kernel", "sgl_kernel"), "pip install sgl-kernel"),
)

PACKAGES_BY_MODULE: Mapping[str, KernelPackage] = {p.module: p for p in KERNEL_PACKAGES}


@dataclass(frozen=True)
class PackageStatus:
    """Whether a kernel package imports here; `error` holds the import failure when it is present but broken."""

    module: str
    installed: bool
    version: str | None = None
    error: str | None = None

    @property
    def usable(self) -> bool:
        return self.installed and self.error is None


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    capability: tuple[int, int] | None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class PlatformSnapshot:
    device_kind: str
    gpus: tuple[GPU, ...] = ()
    torch_version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: str | None = None
    driver_version: str | None = None
    python_version: str = field(default_factory=_pyplatform.python_version)
    os: str = field(default_factory=lambda: f"{_pyplatform.system()} {_pyplatform.machine()}")
    cpu_flags: frozenset[str] = frozenset()
    packages: tuple[PackageStatus, ...] = ()

    @property
    def capability(self) -> tuple[int, int] | None:
        """Compute capability of the first GPU (the one sglx runs on)."""
        return self.gpus[0].capability if self.gpus else None

    @property
    def gpu_name(self) -> str | None:
        return self.gpus[0].name if self.gpus else None

    @property
    def is_gpu(self) -> bool:
        return self.device_kind != "cpu"

    @property
    def torch_device(self) -> str:
        """The torch device string for this device kind."""
        return {"rocm": "cuda", "npu": "npu", "xpu": "xpu", "mps": "mps", "cuda": "cuda"}.get(
            self.device_kind, "cpu"
        )

    def package(self, module: str) -> PackageStatus:
        for status in self.packages:
            if status.module == module:
                return status
        return PackageStatus(module=module, installed=False)

    def with_packages(self, **modules: bool | str) -> PlatformSnapshot:
        """A copy with packages set: True = installed, False = absent, a str = installed but import fails."""
        statuses = {p.module: p for p in self.packages}
        for key, value in modules.items():
            module = key.replace("__", ".")
            if value is True:
                statuses[module] = PackageStatus(module, True, "0.0.0")
            elif value is False:
                statuses[module] = PackageStatus(module, False)
            else:
                statuses[module] = PackageStatus(module, True, "0.0.0", error=str(value))
        return replace(self, packages=tuple(statuses.values()))


def _version_of(pkg: KernelPackage) -> str | None:
    for dist in pkg.distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError, OSError, RuntimeError):
        return False


def probe_package(pkg: KernelPackage) -> PackageStatus:
    """Import one package and record what happened; ABI errors (OSError, RuntimeError) count as broken."""
    if not _module_present(pkg.module.split(".")[0]) or not _module_present(pkg.module):
        return PackageStatus(pkg.module, installed=False)
    version = _version_of(pkg)
    try:
        mod = importlib.import_module(pkg.module)
    except (ImportError, OSError, RuntimeError, AttributeError, SyntaxError) as exc:
        return PackageStatus(pkg.module, True, version, error=f"{type(exc).__name__}: {exc}"[:500])
    if getattr(mod, "__file__", None) is None:  # a bare namespace (flash-attn-4 leaves flash_attn/ without FA2)
        return PackageStatus(pkg.module, installed=False)
    if version is None:
        version = getattr(mod, "__version__", None)
    return PackageStatus(pkg.module, True, str(version) if version else None)


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.stdout.strip().splitlines()
    return line[0].strip() if out.returncode == 0 and line else None


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _torch_facts() -> dict[str, object]:
    """Device kind, GPUs and versions as torch sees them."""
    import torch

    facts: dict[str, object] = {"torch_version": torch.__version__}
    hip = getattr(torch.version, "hip", None)
    facts["cuda_version"] = torch.version.cuda
    facts["hip_version"] = hip
    try:
        cudnn = torch.backends.cudnn.version()
    except (RuntimeError, AttributeError):
        cudnn = None
    if cudnn:
        facts["cudnn_version"] = f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}" if cudnn > 9000 else str(cudnn)
    gpus: list[GPU] = []
    kind = "cpu"
    if torch.cuda.is_available():
        kind = "rocm" if hip else "cuda"
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            gpus.append(GPU(i, prop.name, (prop.major, prop.minor), prop.total_memory))
    elif hasattr(torch, "npu") and _safe_call(lambda: torch.npu.is_available()):
        kind = "npu"
    elif hasattr(torch, "xpu") and _safe_call(lambda: torch.xpu.is_available()):
        kind = "xpu"
        for i in range(torch.xpu.device_count()):
            gpus.append(GPU(i, torch.xpu.get_device_name(i), None))
    elif _safe_call(lambda: torch.backends.mps.is_available()):
        kind = "mps"
        gpus.append(GPU(0, "Apple MPS", None))
    facts["device_kind"] = kind
    facts["gpus"] = tuple(gpus)
    return facts


def _safe_call(fn) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(fn())
    except (RuntimeError, AttributeError, AssertionError):
        return False


@functools.lru_cache(maxsize=1)
def current(probe_packages: bool = True) -> PlatformSnapshot:
    """Snapshot of this machine (cached: the machine does not change while sglx runs)."""
    facts = _torch_facts()
    packages = tuple(probe_package(p) for p in KERNEL_PACKAGES) if probe_packages else ()
    driver = _driver_version() if facts["device_kind"] == "cuda" else None
    return PlatformSnapshot(
        device_kind=str(facts["device_kind"]),
        gpus=facts["gpus"],  # type: ignore[arg-type]
        torch_version=facts.get("torch_version"),  # type: ignore[arg-type]
        cuda_version=facts.get("cuda_version"),  # type: ignore[arg-type]
        hip_version=facts.get("hip_version"),  # type: ignore[arg-type]
        cudnn_version=facts.get("cudnn_version"),  # type: ignore[arg-type]
        driver_version=driver,
        cpu_flags=_cpu_flags(),
        packages=packages,
    )


def fake(
    device_kind: str = "cpu",
    *,
    gpu: str | None = None,
    capability: tuple[int, int] | None = None,
    cuda: str | None = None,
    torch_version: str = "2.9.0",
    packages: Iterable[str] = (),
    broken: Mapping[str, str] | None = None,
    cpu_flags: Iterable[str] = (),
) -> PlatformSnapshot:
    """A snapshot of an imagined machine, for tests and for reasoning about other platforms."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device kind {device_kind!r}; expected one of {', '.join(DEVICE_KINDS)}")
    gpus = (GPU(0, gpu or device_kind.upper(), capability),) if device_kind != "cpu" else ()
    statuses = [PackageStatus(m, True, "0.0.0") for m in packages]
    statuses += [PackageStatus(m, True, "0.0.0", error=e) for m, e in (broken or {}).items()]
    return PlatformSnapshot(
        device_kind=device_kind,
        gpus=gpus,
        torch_version=torch_version,
        cuda_version=cuda if device_kind == "cuda" else None,
        hip_version="6.2" if device_kind == "rocm" else None,
        cpu_flags=frozenset(cpu_flags),
        packages=tuple(statuses),
    )
