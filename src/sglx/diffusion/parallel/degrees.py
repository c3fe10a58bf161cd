"""How many ranks split a DiT's sequence, and how: `--sp-size`, `--ulysses-degree`, `--ring-degree`.

As in xDiT / SGLang diffusion, the sequence-parallel size is ulysses_degree x ring_degree. Ulysses splits
attention heads across its ranks (an all-to-all before and after attention), so the heads must divide by
its degree; ring attention passes key/value blocks around its ranks and merges partial results, so it works
for any head count. Given only `--sp-size N`, all N ranks are Ulysses ranks when the heads divide by N
(SGLang's default) and otherwise the largest Ulysses degree that divides the heads, the rest ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglx.errors import SglxError


@dataclass(frozen=True)
class SPDegrees:
    """The resolved split: `ulysses * ring` ranks share one DiT forward pass."""

    ulysses: int = 1
    ring: int = 1

    @property
    def size(self) -> int:
        return self.ulysses * self.ring

    @property
    def active(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        return f"sp {self.size} (ulysses {self.ulysses} x ring {self.ring})"


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SglxError(f"{flag} {value}: must be an integer >= 1")


def resolve_degrees(sp_size: int | None, ulysses: int | None, ring: int | None,
                    heads: int | None = None) -> SPDegrees:
    """The (ulysses, ring) split for the flags as given; one-line SglxError when they do not fit together."""
    for flag, value in (("--sp-size", sp_size), ("--ulysses-degree", ulysses), ("--ring-degree", ring)):
        _positive(flag, value)
    if sp_size is None:
        degrees = SPDegrees(ulysses or 1, ring or 1)
    elif ulysses is None and ring is None:
        u = sp_size
        if heads is not None and heads % sp_size:
            u = max(d for d in range(1, sp_size + 1) if sp_size % d == 0 and heads % d == 0)
        degrees = SPDegrees(u, sp_size // u)
    elif ulysses is None or ring is None:
        given, flag = (ulysses, "--ulysses-degree") if ulysses is not None else (ring, "--ring-degree")
        assert given is not None
        if sp_size % given:
            raise SglxError(f"--sp-size {sp_size} is not a multiple of {flag} {given}; sp size = ulysses degree x "
                            f"ring degree, so use a {flag} that divides {sp_size}")
        degrees = SPDegrees(given, sp_size // given) if ulysses is not None else SPDegrees(sp_size // given, given)
    else:
        degrees = SPDegrees(ulysses, ring)
        if degrees.size != sp_size:
            raise SglxError(f"--sp-size {sp_size} must equal --ulysses-degree {ulysses} x --ring-degree {ring} "
                            f"= {degrees.size}; give matching sizes or only --sp-size")
    if heads is not None:
        check_heads(degrees, heads)
    return degrees


def check_heads(degrees: SPDegrees, heads: int) -> None:
    """Ulysses hands each rank heads/ulysses heads, so the DiT's heads must divide by the Ulysses degree."""
    if heads % degrees.ulysses:
        ok = [d for d in range(1, degrees.size + 1) if degrees.size % d == 0 and heads % d == 0]
        raise SglxError(f"--ulysses-degree {degrees.ulysses} does not divide the DiT's {heads} attention heads; use "
                        f"a Ulysses degree in {ok} and make up the rest with --ring-degree (e.g. --ulysses-degree "
                        f"{ok[-1]} --ring-degree {degrees.size // ok[-1]})")


def check_world(degrees: SPDegrees, world_size: int) -> None:
    if degrees.size != world_size:
        raise SglxError(f"{degrees.describe()} needs {degrees.size} processes but {world_size} were started; launch "
                        f"{degrees.size} ranks (sglx generate --sp-size {degrees.size} spawns them)")


def check_devices(degrees: SPDegrees, device_type: str, device_count: int) -> None:
    """One rank per GPU: more ranks than GPUs would share a device (and NCCL refuses that)."""
    if device_type == "cuda" and degrees.size > device_count:
        raise SglxError(f"{degrees.describe()} needs {degrees.size} GPUs, this machine has {device_count}; use "
                        f"--sp-size {max(device_count, 1)} or fewer, or --device cpu")
