"""KV memory: the request -> token-slot map and the per-layer K/V buffers (optionally fp8).

Backends never see pages: they read slot indices gathered from `req_to_token`, so page size is an
addressing detail of the allocator. Slot 0 (the whole first page) is reserved as the write target of
padding tokens, so a padded step never corrupts a real request's KV.

fp8 scales (what a reader of an fp8 pool must apply; `TokenKVPool.per_token_scales` says which):

- static (the checkpoint's `k_scale`/`v_scale`; else, for backends that take one scale per layer, computed from
  the first prefill over rotated keys, `calibrate_static_scales`; or 1.0 with --kv-cache-scales one):
  `pool.k_scale[layer]` / `pool.v_scale[layer]` are Python floats; stored = fp8(x / scale), keys rotated first
  when `pool.k_rotation` is set. This is vLLM's and SGLang's per-tensor contract, so a kernel that takes one
  scale per layer (FlashInfer) can read such a pool (rotating its queries when keys are rotated).
- per token (the default when the checkpoint has no scales): `pool.k_scale[layer]` / `pool.v_scale[layer]`
  are float32 tensors `[rows, kv_heads]` (slot-major, like the K/V buffers: a token's heads share one
  32-byte sector, which the neighbouring head programs of a decode kernel read from L2), so slot s of
  head h holds fp8(x / scale[s, h]); and keys are stored in a rotated basis, `pool.k_rotation` (`[D, D]`,
  orthogonal): stored K = fp8((k @ R) / scale). Scores are unchanged if the reader rotates its queries
  (`pool.rotate_query(q)`: (q @ R) . (k @ R) = q . k); V is not rotated. `get_kv` undoes both.

Why per token with a rotation (recall of the embedded tiny-kv-recall model, 62-pair prompts, torch_native,
fp32 model, e4m3; "sim" = K/V rounded in a hook, 100 prompts; else this pool, 200 prompts): one scale of
1.0 per layer 53-54%; a fixed K scale of 0.05 per layer 61% (sim); per-token-and-head scales 79% (sim);
one scale of 1.0 with rotated keys 88% (sim); per-token scales with rotated keys 91.5-94.5% (sim, 200);
plus the scale search with 16 candidates 96.5-97.5%, with 32 (SCALE_SEARCH_STEPS) 98.5-99.5%. The model
(trained under bf16 autocast) needs about 5 mantissa bits on its layer-1 keys (sim: 4 bits 94%, 5 bits
100%) and e4m3 has 3. A scale cannot add mantissa bits (fp8 is floating point: its relative error is the
same at any scale); what helps is (1) the rotation, which spreads a key's few large channels over all
channels so that a score's rounding error averages over D products instead of being one channel's, and
(2) choosing, per token and head, among `SCALE_SEARCH_STEPS` candidates amax/fp8_max * 2^(j/steps), the
scale that rounds that key with the least squared error, i.e. where the key's values fall on the fp8
grid. Per-head static scales cost nothing in a kernel (they fold into the query and the output) but
cannot do (2); per-token scales cost one float32 per token, head and K/V (+3% bytes at head_dim 128) and
one multiply per score and per probability in the kernels, dequantized in-kernel; the query rotation is
one [T*Hq, D] x [D, D] matmul per layer. Values (V) only need the per-token amax scale (rounding V alone
never cost recall). e5m2 (2 mantissa bits) reaches 90.5-91.5% this way (static 1.0: 14%).
"""

from __future__ import annotations

import logging

import torch

from sglx.errors import SglxError

log = logging.getLogger(__name__)

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPE_CHOICES = ("auto", *FP8_DTYPES)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_SEARCH_STEPS = 32
"""Candidate scales per key (token, head): amax/fp8_max * 2^(j/32), j < 32; the least-error one is kept."""
MIN_SCALE = 2.0 ** -24
"""Smallest per-token scale (an all-zero row still divides by something finite)."""
ROTATION_SEED = 20261123


def kv_rotation(dim: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The fixed orthogonal [dim, dim] matrix keys are rotated by before fp8 rounding (seeded, float32).

    Q of a random Gaussian matrix, built in float64 on the CPU so every device and process gets the same one.
    """
    gen = torch.Generator().manual_seed(ROTATION_SEED + dim)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]  # unique QR: a well-defined matrix
    return q.to(torch.float32).contiguous().to(device)


def scale_multipliers(steps: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """float32 [steps]: 2^(j/steps); kernels and the pool multiply the base scale by the same numbers."""
    return torch.tensor([2.0 ** (j / steps) for j in range(steps)], dtype=torch.float32, device=device)


def quantize_per_token(x: torch.Tensor, fp8_dtype: torch.dtype, multipliers: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x [T, H, D] -> (uint8 fp8 bits [T, H, D], float32 scale [T, H]) with bits * scale ~ x.

    The base scale maps each row's amax to the format's largest value; with `multipliers` each candidate
    base * m is tried and the first one with the least squared rounding error is kept (the Triton store
    kernel does the same arithmetic; the summation order of the errors may break near-ties differently).
    """
    base = torch.clamp(x.abs().amax(-1) / FP8_MAX[fp8_dtype], min=MIN_SCALE)
    if multipliers is None:
        return (x / base[..., None]).to(fp8_dtype).view(torch.uint8), base
    best_bits = best_scale = best_err = None
    for m in multipliers:
        scale = base * m
        q = (x / scale[..., None]).to(fp8_dtype)
        err = ((q.float() * scale[..., None] - x) ** 2).sum(-1)
        if best_err is None:
            best_bits, best_scale, best_err = q, scale, err
            continue
        better = err < best_err
        best_bits = torch.where(better[..., None], q.view(torch.uint8), best_bits.view(torch.uint8)).view(fp8_dtype)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    assert best_bits is not None and best_scale is not None
    return best_bits.view(torch.uint8), best_scale


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot of token `pos` of the request living in `row`; row 0 is padding."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self._free = list(range(size, 0, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row <= 0 or row > self.size or row in self._free:
            raise ValueError(f"req_to_token row {row} is not allocated")
        self._free.append(row)


class TokenKVPool:
    """One K and one V buffer per layer, `[num_slots + page_size, kv_heads, head_dim]`.

    fp8 KV is stored as uint8 bits. `per_token_scales=True` (what the engine uses unless the checkpoint
    brings scales): a scale per token, head and K/V, computed at store time, keys rotated (module docstring).
    False: one static scale per layer for K and one for V (`k_scale`/`v_scale` lists of floats, 1.0 until
    `set_static_scales`): stored = fp8(x / scale), read back as stored * scale.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        device: str | torch.device = "cpu",
        v_head_dim: int | None = None,
        per_token_scales: bool = False,
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise SglxError(
                f"--kv-cache-dtype {kv_cache_dtype}: not supported; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        self.fp8_dtype = FP8_DTYPES.get(kv_cache_dtype)
        store = torch.uint8 if self.fp8_dtype is not None else dtype
        rows = num_slots + page_size
        self.k_buffer = [torch.zeros((rows, num_kv_heads, head_dim), dtype=store, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros((rows, num_kv_heads, self.v_head_dim), dtype=store, device=device)
                         for _ in range(num_layers)]
        self.per_token_scales = per_token_scales and self.fp8_dtype is not None
        self.k_rotation: torch.Tensor | None = None
        self.scale_multipliers: torch.Tensor | None = None
        self.k_scale: list = [1.0] * num_layers
        self.v_scale: list = [1.0] * num_layers
        self.scales_pending = [False] * num_layers  # static scales still to be computed from the first store
        self.calibrating = False  # any(scales_pending), kept as one flag for the per-layer store path
        self.scale_source = "none" if self.fp8_dtype is None else "per_token" if self.per_token_scales else "one"
        self.unquantized_layers: frozenset[int] = frozenset()  # fp8 pools: layers kept in the model dtype
        if self.per_token_scales:
            self.k_rotation = kv_rotation(head_dim, device)
            self.scale_multipliers = scale_multipliers(SCALE_SEARCH_STEPS, device)
            self.k_scale = [torch.ones((rows, num_kv_heads), dtype=torch.float32, device=device)
                            for _ in range(num_layers)]
            self.v_scale = [torch.ones((rows, num_kv_heads), dtype=torch.float32, device=device)
                            for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.fp8_dtype is not None

    def layer_fp8_dtype(self, layer_id: int) -> torch.dtype | None:
        """The fp8 format layer `layer_id` stores, or None where it keeps the model dtype (`keep_unquantized`)."""
        return None if layer_id in self.unquantized_layers else self.fp8_dtype

    def bytes_per_token(self) -> int:
        model_elem = torch.tensor([], dtype=self.dtype).element_size()
        scales = 2 * 4 if self.per_token_scales else 0  # float32 K and V scale per head
        return sum(self.num_kv_heads * ((self.head_dim + self.v_head_dim) * (
            1 if self.layer_fp8_dtype(i) is not None else model_elem) + scales) for i in range(self.num_layers))

    def keep_unquantized(self, layers: tuple[int, ...]) -> None:
        """Store these layers' K/V in the model dtype, the rest fp8 (vLLM's `kv_cache_dtype_skip_layers`).

        For pools with one static scale per layer (FlashInfer, XQA): a layer whose keys need more than e4m3's 3
        mantissa bits (the embedded model's layer 1) loses recall at any static scale, and kernels that take one
        scalar scale cannot use per-token ones. Keys of such layers are still stored rotated when the pool rotates
        keys, so one query rotation serves every layer. Only before anything is stored.
        """
        if not self.is_fp8 or not layers:
            return
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise SglxError(f"--kv-cache-dtype-skip-layers {','.join(map(str, bad))}: the model has layers "
                            f"0..{self.num_layers - 1}")
        if self.per_token_scales:
            raise SglxError("--kv-cache-dtype-skip-layers applies to fp8 pools with one scale per layer "
                            "(--kv-cache-scales calibrate or one, or checkpoint scales); per-token scales keep "
                            "every layer's accuracy without it")
        self.unquantized_layers = frozenset(layers)
        for i in self.unquantized_layers:
            self.k_buffer[i] = torch.zeros(self.k_buffer[i].shape, dtype=self.dtype, device=self.device)
            self.v_buffer[i] = torch.zeros(self.v_buffer[i].shape, dtype=self.dtype, device=self.device)
            self.k_scale[i] = self.v_scale[i] = 1.0
            self.scales_pending[i] = False
        self.calibrating = any(self.scales_pending)

    def set_static_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Use one fixed K and one V scale per layer (a checkpoint's `k_scale`/`v_scale`) instead of per-token ones.

        Only before anything is stored: the bytes already in the pool were written with the old scales.
        """
        if not self.is_fp8:
            return
        if len(k_scales) != self.num_layers or len(v_scales) != self.num_layers:
            raise SglxError(f"KV scales for {len(k_scales)}/{len(v_scales)} layers, the model has {self.num_layers}")
        self.per_token_scales = False
        self.k_rotation = self.scale_multipliers = None
        self.k_scale = [float(s) for s in k_scales]
        self.v_scale = [float(s) for s in v_scales]
        self.scales_pending = [False] * self.num_layers
        self.calibrating = False
        self.scale_source = "given"

    def calibrate_static_scales(self, rotate_keys: bool = True) -> None:
        """One K and one V scale per layer, computed from the first K/V each layer stores, then frozen.

        vLLM's `--calculate-kv-scales` rule (`kv_scale_calibration.first_batch_scale`), for kernels that take one
        scale per layer. `rotate_keys`: keys stored as fp8((k @ R) / scale) with the pool's fixed rotation, read
        by rotating queries (`rotate_query`); `get_kv` undoes it. Only before anything is stored.
        """
        if not self.is_fp8:
            return
        self.per_token_scales = False
        self.scale_multipliers = None
        self.k_rotation = kv_rotation(self.head_dim, self.device) if rotate_keys else None
        self.k_scale = [1.0] * self.num_layers
        self.v_scale = [1.0] * self.num_layers
        self.scales_pending = [i not in self.unquantized_layers for i in range(self.num_layers)]
        self.calibrating = any(self.scales_pending)
        self.scale_source = "calibrated_rotated" if rotate_keys else "calibrated"

    def calibrate_layer(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Freeze layer `layer_id`'s static scales from these (unrotated) K/V if they are still pending."""
        if not self.calibrating or not self.scales_pending[layer_id] or k.numel() == 0:
            return
        from sglx.llm.kv_scale_calibration import K_RANGE, V_RANGE, first_batch_scale

        keys = k.float() @ self.k_rotation if self.k_rotation is not None else k
        self.k_scale[layer_id] = first_batch_scale(keys, K_RANGE)
        self.v_scale[layer_id] = first_batch_scale(v, V_RANGE)
        self.scales_pending[layer_id] = False
        self.calibrating = any(self.scales_pending)
        if not self.calibrating:
            log.info("fp8 KV scales calibrated from the first batch (%s): k %s, v %s", self.scale_source,
                     [f"{x:.4g}" for x in self.k_scale], [f"{x:.4g}" for x in self.v_scale])

    def describe_scales(self) -> dict[str, object]:
        """What a reader of this pool applies: the scale source and, for static scales, the per-layer values."""
        out: dict[str, object] = {"source": self.scale_source, "rotated_keys": self.k_rotation is not None}
        if self.is_fp8 and not self.per_token_scales:
            out["pending"] = any(self.scales_pending)
            out["k_scale"] = [round(float(x), 6) for x in self.k_scale]
            out["v_scale"] = [round(float(x), 6) for x in self.v_scale]
            if self.unquantized_layers:
                out["unquantized_layers"] = sorted(self.unquantized_layers)
        return out

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., D] in the basis the pool stores keys in (q @ R; q itself when keys are not rotated)."""
        if self.k_rotation is None:
            return q
        return (q.float() @ self.k_rotation).to(q.dtype)

    def _encode(self, x: torch.Tensor, scale: float, layer_id: int | None = None) -> torch.Tensor:
        fp8 = self.fp8_dtype if layer_id is None else self.layer_fp8_dtype(layer_id)
        if fp8 is None:
            return x.to(self.dtype)
        scaled = x.float() / scale if scale != 1.0 else x.float()
        return scaled.to(fp8).view(torch.uint8)

    def decode(self, stored: torch.Tensor, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored K or V rows back in compute dtype (dequantized for fp8; rows of the model dtype as they are)."""
        dtype = dtype or self.dtype
        if self.fp8_dtype is None or stored.dtype != torch.uint8:
            return stored.to(dtype)
        values = stored.view(self.fp8_dtype).to(torch.float32)
        return (values * scale if scale != 1.0 else values).to(dtype)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.per_token_scales:
            assert self.fp8_dtype is not None and self.k_rotation is not None
            k_bits, k_scale = quantize_per_token(k.float() @ self.k_rotation, self.fp8_dtype, self.scale_multipliers)
            v_bits, v_scale = quantize_per_token(v.float(), self.fp8_dtype, None)
            self.k_buffer[layer_id][loc] = k_bits
            self.v_buffer[layer_id][loc] = v_bits
            self.k_scale[layer_id][loc] = k_scale
            self.v_scale[layer_id][loc] = v_scale
            return
        if self.calibrating:
            self.calibrate_layer(layer_id, k, v)
        if self.k_rotation is not None:
            k = k.float() @ self.k_rotation
        self.k_buffer[layer_id][loc] = self._encode(k, self.k_scale[layer_id], layer_id)
        self.v_buffer[layer_id][loc] = self._encode(v, self.v_scale[layer_id], layer_id)

    def get_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, dequantized to `dtype` (per-token scales applied, rotation undone)."""
        if self.per_token_scales:
            assert self.fp8_dtype is not None and self.k_rotation is not None
            dtype = dtype or self.dtype
            k_scale = self.k_scale[layer_id][loc][..., None]
            v_scale = self.v_scale[layer_id][loc][..., None]
            k = self.k_buffer[layer_id][loc].view(self.fp8_dtype).float() * k_scale
            v = self.v_buffer[layer_id][loc].view(self.fp8_dtype).float() * v_scale
            return (k @ self.k_rotation.t()).to(dtype), v.to(dtype)
        v = self.decode(self.v_buffer[layer_id][loc], self.v_scale[layer_id], dtype)
        if self.k_rotation is not None:  # static scales with rotated keys
            k = self.decode(self.k_buffer[layer_id][loc], self.k_scale[layer_id], torch.float32)
            return (k @ self.k_rotation.t()).to(dtype or self.dtype), v
        return self.decode(self.k_buffer[layer_id][loc], self.k_scale[layer_id], dtype), v
