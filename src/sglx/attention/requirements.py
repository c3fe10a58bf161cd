"""Small predicates a backend declares it needs; each answers None (met) or a sentence a user can act on."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sglx.attention.request import AttentionRequest
from sglx.platform import PACKAGES_BY_MODULE, PlatformSnapshot

_DEVICE_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "mps": "MPS", "npu": "Ascend NPU", "xpu": "Intel XPU", "cpu": "CPU"}


def device_name(kind: str) -> str:
    return _DEVICE_NAMES.get(kind, kind)


def parse_version(text: str | None) -> tuple[int, ...]:
    """Leading numeric parts of a version string: '12.4.1+cu' -> (12, 4, 1)."""
    if not text:
        return ()
    parts = []
    for piece in re.split(r"[.+\-]", text):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def fmt_cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


class Requirement:
    """Base: `check` returns None when met, else the reason; `describe` says it for the docs."""

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class OnPlatform(Requirement):
    kinds: tuple[str, ...]

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if snap.device_kind in self.kinds:
            return None
        wanted = " or ".join(device_name(k) for k in self.kinds)
        return f"runs on {wanted} only; this machine is {device_name(snap.device_kind)}"

    def describe(self) -> str:
        return " or ".join(device_name(k) for k in self.kinds)


@dataclass(frozen=True)
class Capability(Requirement):
    """Compute capability in [min, max] (inclusive); only meaningful on CUDA."""

    min: tuple[int, int] | None = None
    max: tuple[int, int] | None = None

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if snap.device_kind != "cuda":
            return None
        cc = snap.capability
        if cc is None:
            return "needs an NVIDIA GPU whose compute capability is known"
        if self.min and cc < self.min:
            return f"needs compute capability >= {fmt_cc(self.min)}, this GPU ({snap.gpu_name}) is {fmt_cc(cc)}"
        if self.max and cc > self.max:
            return f"needs compute capability <= {fmt_cc(self.max)}, this GPU ({snap.gpu_name}) is {fmt_cc(cc)}"
        return None

    def describe(self) -> str:
        if self.min and self.max:
            return f"SM{self.min[0]}{self.min[1]}-SM{self.max[0]}{self.max[1]}"
        if self.min:
            return f"SM{self.min[0]}{self.min[1]}+"
        return f"up to SM{self.max[0]}{self.max[1]}" if self.max else "any GPU"


@dataclass(frozen=True)
class CapabilityIn(Requirement):
    """Compute capability major.minor in a fixed set, or a whole major when minor is None."""

    allowed: tuple[tuple[int, int | None], ...]

    def _matches(self, cc: tuple[int, int]) -> bool:
        return any(cc[0] == major and (minor is None or cc[1] == minor) for major, minor in self.allowed)

    def _names(self) -> str:
        return ", ".join(f"{a}.{b}" if b is not None else f"{a}.x" for a, b in self.allowed)

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if snap.device_kind != "cuda":
            return None
        cc = snap.capability
        if cc is None or not self._matches(cc):
            have = fmt_cc(cc) if cc else "unknown"
            return f"needs compute capability {self._names()}, this GPU ({snap.gpu_name}) is {have}"
        return None

    def describe(self) -> str:
        return "SM " + self._names()


@dataclass(frozen=True)
class CudaAtLeast(Requirement):
    version: tuple[int, int]

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if snap.device_kind != "cuda":
            return None
        have = parse_version(snap.cuda_version)
        if have and have >= self.version:
            return None
        need = ".".join(map(str, self.version))
        return f"needs CUDA >= {need}, torch here is built with CUDA {snap.cuda_version or 'unknown'}"

    def describe(self) -> str:
        return "CUDA >= " + ".".join(map(str, self.version))


@dataclass(frozen=True)
class TorchAtLeast(Requirement):
    version: tuple[int, int]

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        have = parse_version(snap.torch_version)
        if have and have >= self.version:
            return None
        need = ".".join(map(str, self.version))
        return f"needs torch >= {need}, this is torch {snap.torch_version or 'unknown'}"

    def describe(self) -> str:
        return "torch >= " + ".".join(map(str, self.version))


def _install_hint(module: str) -> str:
    pkg = PACKAGES_BY_MODULE.get(module)
    return pkg.install_hint if pkg else f"pip install {module}"


@dataclass(frozen=True)
class Package(Requirement):
    """One kernel package must import; any of `modules` will do when several provide the kernel."""

    modules: tuple[str, ...]
    min_version: tuple[int, ...] | None = None

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        problems = []
        for module in self.modules:
            status = snap.package(module)
            if status.installed and status.error:
                problems.append(f"package {module} is installed but fails to import: {status.error}")
            elif status.installed:
                have = parse_version(status.version)
                if self.min_version and have and have < self.min_version:
                    need = ".".join(map(str, self.min_version))
                    problems.append(f"package {module} {status.version} is too old (needs >= {need})")
                else:
                    return None
        if problems:
            return "; ".join(problems)
        names = " or ".join(self.modules)
        return f"package {names} is not installed ({_install_hint(self.modules[0])})"

    def describe(self) -> str:
        ver = f" >= {'.'.join(map(str, self.min_version))}" if self.min_version else ""
        return " or ".join(f"`{m}`" for m in self.modules) + ver


@dataclass(frozen=True)
class CpuFlags(Requirement):
    """CPU instruction-set flags from /proc/cpuinfo, e.g. Intel AMX."""

    flags: tuple[str, ...]

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        missing = [f for f in self.flags if f not in snap.cpu_flags]
        if not missing:
            return None
        return f"needs a CPU with {', '.join(missing)} (Intel Sapphire Rapids or newer); this CPU lacks them"

    def describe(self) -> str:
        return "CPU flags " + ", ".join(self.flags)


@dataclass(frozen=True)
class Dtypes(Requirement):
    allowed: tuple[str, ...]

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if req.dtype is None or req.dtype in self.allowed:
            return None
        return f"dtype {req.dtype} is not supported: needs {' or '.join(self.allowed)} (--dtype)"

    def describe(self) -> str:
        return "dtype " + "/".join(a.replace("float", "fp").replace("bfp", "bf") for a in self.allowed)


@dataclass(frozen=True)
class HeadDims(Requirement):
    """Head dimension limits: an explicit set, or a maximum and a multiple."""

    allowed: tuple[int, ...] = ()
    max: int | None = None
    multiple_of: int | None = None
    what: str = "head dim"  # how messages name it (MLA kernels: the latent width kv_lora_rank + qk_rope_head_dim)

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        d = req.head_dim
        if d is None:
            return None
        if self.allowed and d not in self.allowed:
            return f"{self.what} {d} is not supported: needs one of {', '.join(map(str, self.allowed))}"
        if self.max is not None and d > self.max:
            return f"{self.what} {d} is not supported: needs <= {self.max}"
        if self.multiple_of and d % self.multiple_of:
            return f"{self.what} {d} is not supported: needs a multiple of {self.multiple_of}"
        return None

    def describe(self) -> str:
        if self.allowed:
            return f"{self.what} " + "/".join(map(str, self.allowed))
        parts = []
        if self.max is not None:
            parts.append(f"<= {self.max}")
        if self.multiple_of:
            parts.append(f"multiple of {self.multiple_of}")
        return f"{self.what} " + ", ".join(parts)


@dataclass(frozen=True)
class OnlyOn(Requirement):
    """A requirement that applies on some device kinds only (e.g. SM80+ on CUDA, nothing on ROCm)."""

    kinds: tuple[str, ...]
    inner: Requirement

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        return self.inner.check(snap, req) if snap.device_kind in self.kinds else None

    def describe(self) -> str:
        return f"{self.inner.describe()} (on {'/'.join(device_name(k) for k in self.kinds)})"


@dataclass(frozen=True)
class Explained(Requirement):
    """A requirement whose failure needs its cause said too (a vendor kernel narrower than its package)."""

    inner: Requirement
    why: str

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        reason = self.inner.check(snap, req)
        return f"{reason} ({self.why})" if reason else None

    def describe(self) -> str:
        return self.inner.describe()


def platforms_of(requires: Iterable[Requirement]) -> tuple[str, ...]:
    """The device kinds a backend can run on, as its OnPlatform requirement states (all when absent)."""
    for r in requires:
        if isinstance(r, OnPlatform):
            return r.kinds
    return ("cuda", "rocm", "mps", "npu", "xpu", "cpu")


@dataclass(frozen=True)
class Variant:
    """One implementation of a backend (FA3, FA4, FA2 of `fa`) with the requirements of that one alone."""

    name: str
    module: str  # the package that provides it, shown by doctor
    requires: tuple[Requirement, ...]

    def failures(self, snap: PlatformSnapshot, req: AttentionRequest) -> list[str]:
        return [r for r in (q.check(snap, req) for q in self.requires) if r]


@dataclass(frozen=True)
class AnyVariant(Requirement):
    """Met when every requirement of one variant holds; variants are in order of preference.

    A backend with several kernels (FlashAttention 3, 4 and 2 need different GPUs and packages) states
    each kernel's needs here, so doctor and selection say which one runs, or why none does.
    """

    label: str  # "FlashAttention", for the reason when no variant runs
    variants: tuple[Variant, ...]

    def chosen(self, snap: PlatformSnapshot, req: AttentionRequest) -> Variant | None:
        return next((v for v in self.variants if not v.failures(snap, req)), None)

    def check(self, snap: PlatformSnapshot, req: AttentionRequest) -> str | None:
        if self.chosen(snap, req) is not None:
            return None
        why = "; ".join(f"{v.name}: {', '.join(v.failures(snap, req))}" for v in self.variants)
        return f"no {self.label} variant runs here ({why})"

    def describe(self) -> str:
        return "one of " + "; ".join(
            f"{v.name} ({', '.join(r.describe() for r in v.requires)})" for v in self.variants)
