"""`torch.randn(..., device="cuda", generator=g)` on the CPU, so GPU test data can be re-derived on a CPU box.

PyTorch's CUDA normal kernel (ATen/native/cuda/DistributionTemplates.h): a grid-stride loop with 256-thread blocks,
at most (SMs * maxThreadsPerSM / 256) blocks; thread i runs curand's Philox4x32-10 on subsequence i from the
generator's offset, and each curand_normal4 call (Box-Muller on two pairs: sin, cos) fills elements
i + k * 4T + j * T. Each call advances the generator's offset by ((n - 1) // (4T) + 1) * 4. Only the float stream
is modelled (fp16/bf16 results are its values rounded); the fast sin/cos/log of the device may differ in the last
float bit, which almost never survives rounding to bf16.
"""

from __future__ import annotations

import numpy as np
import torch

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_INV = np.float32(2.3283064e-10)  # CURAND_2POW32_INV
_INV_2PI = np.float32(2.3283064e-10 * 6.2831855)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):  # noqa: ANN001, ANN201
    """Random123's Philox4x32-10 (as curand implements it) on uint32 arrays of counters."""
    c = [np.asarray(x, dtype=np.uint32) for x in (c0, c1, c2, c3)]
    for r in range(10):
        p0 = _M0 * c[0].astype(np.uint64)
        p1 = _M1 * c[2].astype(np.uint64)
        c = [(p1 >> np.uint64(32)).astype(np.uint32) ^ c[1] ^ np.uint32(k0), (p1 & _LOW).astype(np.uint32),
             (p0 >> np.uint64(32)).astype(np.uint32) ^ c[3] ^ np.uint32(k1), (p0 & _LOW).astype(np.uint32)]
        if r < 9:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return c


def _box_muller(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u = x.astype(np.float32) * _INV + np.float32(_INV / 2)
    v = (y.astype(np.float32) * _INV_2PI + np.float32(_INV_2PI / 2)).astype(np.float64)
    s = np.sqrt(np.float32(-2.0) * np.log(u)).astype(np.float32)
    return np.sin(v).astype(np.float32) * s, np.cos(v).astype(np.float32) * s


class CudaRandn:
    """A CUDA generator after manual_seed(seed) on a GPU with `sm_count` SMs (H100 SXM: 132, 2048 threads each)."""

    def __init__(self, seed: int, sm_count: int = 132, threads_per_sm: int = 2048) -> None:
        self.seed, self.offset = seed, 0
        self.max_blocks = sm_count * (threads_per_sm // 256)

    def skip(self, numel: int) -> None:
        """Advance as a randn of `numel` elements would, without computing it."""
        self.offset += self._increment(numel)[0]

    def _increment(self, numel: int) -> tuple[int, int]:
        threads = min(self.max_blocks, -(-numel // 256)) * 256
        return ((numel - 1) // (4 * threads) + 1) * 4, threads

    def randn(self, *shape: int) -> torch.Tensor:
        numel = int(np.prod(shape))
        inc, threads = self._increment(numel)
        base, self.offset = self.offset, self.offset + inc
        out = np.empty(numel, dtype=np.float32)
        idx = np.arange(threads, dtype=np.uint64)
        for k in range(-(-numel // (4 * threads))):
            ctr = base // 4 + k  # curand_init(seed, subsequence=i, offset) then one counter step per call
            c = philox4x32_10(np.full(threads, ctr & 0xFFFFFFFF, np.uint32), np.full(threads, ctr >> 32, np.uint32),
                              (idx & _LOW).astype(np.uint32), (idx >> np.uint64(32)).astype(np.uint32),
                              self.seed & 0xFFFFFFFF, self.seed >> 32)
            for j, values in enumerate((*_box_muller(c[0], c[1]), *_box_muller(c[2], c[3]))):
                at = idx.astype(np.int64) + k * 4 * threads + j * threads
                keep = at < numel
                out[at[keep]] = values[keep]
        return torch.from_numpy(out).view(*shape)
