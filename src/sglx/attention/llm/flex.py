"""flex_attention: PyTorch FlexAttention reading K/V in place from the paged pool through block masks.

Each step plans once (`init_forward_metadata`): the step's keys as (request, position, slot) from
`req_to_token`, the inverse slot -> position table, and lazily per sliding window one `BlockMask`
(flex_masks.py). Every layer then makes ONE flex_attention call: extend packs all new tokens as
[1, Hq, T] queries (prefix + causal among themselves, several requests per call), decode runs
[bs, Hq, 1] queries against the pool broadcast over the batch. GQA is flex's own (enable_gqa), the
logit soft-cap a score_mod, sliding windows part of the mask.

Compiled (`compile=on`) the keys are the whole pool in place (no copy) and the
fused kernel visits only the listed key blocks; on CUDA extend also lists full blocks (no mask
evaluated there); decode runs static batches padded to a power of two (flex's split-KV decoding
kernel needs a static batch). Eager (`compile=off`; `auto` is eager everywhere for now) flex materializes the
scores over every key it is given, so the keys are gathered once per layer: the step's own slots for
extend, and for decode each request's own keys as one row of a [bs, Hkv, max_len] batch. On CPU the
compiled path builds static shapes only (each new batch shape recompiles, seconds each on two cores;
dynamic shapes and full blocks hit Inductor C++ template bugs in torch 2.13), hence eager there:
`compile=on` on CPU is for checking the fused path, not for serving (past dynamo's recompile limit
torch falls back to eager over the whole pool).
No fp8 KV (flex takes the pool's dtype as is) and no CUDA graphs (the block mask is rebuilt per step).

Why `auto` does not compile on CUDA: on the lent H100 (torch 2.11+cu130) the compiled extend failed to
build in Inductor in 5 of 5 step-by-step GPU tests (NoValidChoicesError, flex template out of shared
memory, unbacked bindings); only the small engine HF-parity test passed compiled. Eager is the path the
CPU suite proves; compiled stays opt-in until its GPU tests pass. A probe run alone in a fresh process
(benchmarks/probe_flex_compile.py, results/flex_probe_h100.json, 2026-11-23) narrowed this down. The page-1,
head-dim-128 case lowered and matched float64 when compiled, for extend and decode, with dynamic or static
shapes, with or without full blocks. The NoValidChoicesError of that case is therefore not in its own
lowering; the suspected cause is dynamo's automatic-dynamic recompiles after earlier parametrisations in the
same process (not yet confirmed). The head-dim-64 case (page 64, GQA 8, window 700) fails however it is
compiled: Inductor's flex template config needs 248,832 B of shared memory, and the H100 has 232,448 B. The
probe ran out of time before it could try smaller kernel_options.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from sglx.attention.llm.base import AttentionBackend, BackendContext, LayerSpec
from sglx.attention.llm.flex_masks import (
    KVLayout,
    StepKeys,
    StepTables,
    decode_block_mask,
    extend_block_mask,
    gathered_layout,
    kv_tokens,
    own_keys_decode_block_mask,
    slot_positions,
    soft_cap_score_mod,
)
from sglx.errors import BackendUnavailableError, ConfigError
from sglx.llm.forward_batch import ForwardBatch

COMPILE_CHOICES = ("auto", "on", "off")

# Eager is chosen knowingly where compiling does not pay (CPU); torch's advice to compile is noise there.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def _flex_extend(*args: Any, **kwargs: Any) -> torch.Tensor:
    return flex_attention(*args, **kwargs)


def _flex_decode(*args: Any, **kwargs: Any) -> torch.Tensor:
    return flex_attention(*args, **kwargs)


# Compiled decode is static in the batch (flex's split-KV decoding kernel needs a static batch, dynamic
# ones fall back to the prefill kernel with 127 of 128 query rows idle), padded to a power of two: one
# graph per bucket, so the per-function recompile limit must cover every bucket up to a few thousand.
RECOMPILE_LIMIT = 64


@lru_cache(maxsize=4)
def _compiled_flex(decode: bool, dynamic: bool) -> Callable:
    """One compiled flex_attention per phase and process, shared by every backend instance and layer.

    Two wrappers, so extend and decode keep separate dynamo caches (and recompile limits). Past the
    limit torch would run flex eagerly, materializing scores over the whole pool: raise it once here.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(_flex_decode if decode else _flex_extend, dynamic=dynamic)


def compile_failure(exc: BaseException) -> bool:
    """Whether exc is torch.compile failing to build a kernel (Inductor lowering, dynamo's backend), not bad input."""
    return type(exc).__module__.startswith(("torch._inductor", "torch._dynamo"))


def decode_bucket(bs: int) -> int:
    """Batch size a compiled decode step runs at: the next power of two (padding rows attend to nothing)."""
    return 1 << max(bs - 1, 0).bit_length()


def resolve_compile(setting: object, device: torch.device) -> bool:
    """`compile` config value (validated against the registry's choices) -> run compiled on this device?"""
    value = "auto" if setting is None else str(setting)
    if value not in COMPILE_CHOICES:
        raise ConfigError(f"flex_attention config compile={setting!r}: choose one of {', '.join(COMPILE_CHOICES)} "
                          "(auto runs eager: the compiled CUDA path is opt-in until its GPU tests pass)")
    return value == "on"


@dataclass
class _Step:
    """One step's plan; block masks are built on first use per sliding window and reused by later layers."""

    decode: bool
    layout: KVLayout | None
    tables: StepTables | None
    keys: StepKeys | None
    seq_lens: list[int]
    qo_indptr: list[int]
    prefix_lens: list[int]
    batch_rows: int  # decode: the batch flex runs (padded to a bucket when compiled)
    full_blocks: bool  # list mask-free blocks apart (CUDA; Inductor's CPU template fails to build them)
    own_slots: torch.Tensor | None = None  # eager decode: [bs, max_len] each request's slots (padded: slot 0)
    masks: dict[int | None, BlockMask] = field(default_factory=dict)

    def block_mask(self, sliding_window: int | None) -> BlockMask:
        if sliding_window not in self.masks:
            if self.own_slots is not None:
                mask = own_keys_decode_block_mask(self.seq_lens, sliding_window, self.own_slots.device)
            elif self.decode:
                assert self.tables is not None and self.layout is not None and self.keys is not None
                mask = decode_block_mask(self.tables, self.layout, self.keys, self.seq_lens, sliding_window,
                                         self.batch_rows)
            else:
                assert self.tables is not None and self.layout is not None and self.keys is not None
                mask = extend_block_mask(self.tables, self.layout, self.keys, self.qo_indptr, self.prefix_lens,
                                         sliding_window, full_blocks=self.full_blocks)
            self.masks[sliding_window] = mask
        return self.masks[sliding_window]


class FlexAttentionBackend(AttentionBackend):
    name = "flex_attention"
    supports_cuda_graph = False

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.token_kv_pool.is_fp8:
            raise BackendUnavailableError(
                f"attention backend flex_attention cannot read an fp8 KV cache (--kv-cache-dtype "
                f"{ctx.token_kv_pool.kv_cache_dtype}); use --kv-cache-dtype auto, or --attention-backend "
                "triton or torch_native for fp8 KV")
        self.compiled = resolve_compile(ctx.config.get("compile", "auto"), ctx.device)
        # CPU Inductor compiles flex only with static shapes (dynamic ones fail to build in torch 2.13)
        # (decode is static: see RECOMPILE_LIMIT)
        dynamic = ctx.device.type == "cuda"
        self._flex = {False: _compiled_flex(False, dynamic), True: _compiled_flex(True, False)} if self.compiled \
            else {False: flex_attention, True: flex_attention}
        self._score_mods: dict[float, Callable] = {}
        self.step: _Step | None = None

    # ------------------------------------------------------------------ metadata
    def _layout(self, slots: torch.Tensor) -> KVLayout:
        if self.compiled or slots.numel() == 0:  # whole pool in place: fixed shapes, the block lists skip
            return KVLayout(int(self.ctx.token_kv_pool.k_buffer[0].shape[0]))
        return gathered_layout(slots)  # eager scores every key it is given: only the step's own

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        r2t = batch.req_to_token_pool.req_to_token
        rows = [int(r) for r in batch.req_pool_indices.tolist()]
        seq_lens = list(batch.seq_lens_cpu)
        if batch.mode.is_decode and not self.compiled:
            self.step = self._own_keys_step(r2t, rows, seq_lens)
            return
        req, pos, slots = kv_tokens(r2t, rows, seq_lens)
        layout = self._layout(slots)
        keys = StepKeys(req, pos, layout.key_rows(slots))
        device = r2t.device
        decode = batch.mode.is_decode
        batch_rows = len(rows)
        if decode:
            batch_rows = decode_bucket(len(rows)) if self.compiled else len(rows)
            pad = batch_rows - len(rows)
            q_rows = torch.tensor(rows + [0] * pad, dtype=torch.int32, device=device)
            q_pos = torch.tensor([s - 1 for s in seq_lens] + [-1] * pad, dtype=torch.int32, device=device)
            qo_indptr, prefix = list(range(len(rows) + 1)), [s - 1 for s in seq_lens]
        else:
            ext, prefix = list(batch.extend_seq_lens_cpu), list(batch.extend_prefix_lens_cpu)
            lens = torch.tensor(ext, dtype=torch.long, device=device)
            which = torch.repeat_interleave(torch.arange(len(rows), device=device), lens)
            starts = torch.cumsum(lens, 0) - lens
            offset = torch.arange(int(lens.sum()), device=device) - starts[which]
            q_rows = torch.tensor(rows, dtype=torch.int32, device=device)[which]
            q_pos = (torch.tensor(prefix, dtype=torch.long, device=device)[which] + offset).to(torch.int32)
            qo_indptr = [0]
            for n in ext:
                qo_indptr.append(qo_indptr[-1] + n)
        key_slot = None if layout.slots is None else layout.slots.to(torch.int32)
        tables = StepTables(r2t, slot_positions(keys, layout), q_rows, q_pos, key_slot)
        self.step = _Step(decode, layout, tables, keys, seq_lens, qo_indptr, prefix, batch_rows,
                          full_blocks=self.ctx.device.type == "cuda")

    @staticmethod
    def _own_keys_step(r2t: torch.Tensor, rows: list[int], seq_lens: list[int]) -> _Step:
        """Eager decode: each request's own slots as one padded row, so no entry scores another's keys."""
        max_len = max(seq_lens)
        own = r2t[torch.tensor(rows, dtype=torch.long, device=r2t.device), :max_len].long()
        lens = torch.tensor(seq_lens, device=r2t.device)
        own = own.masked_fill(torch.arange(max_len, device=r2t.device)[None, :] >= lens[:, None], 0)
        return _Step(True, None, None, None, seq_lens, list(range(len(rows) + 1)), [s - 1 for s in seq_lens],
                     len(rows), full_blocks=False, own_slots=own)

    # ------------------------------------------------------------------ attention
    def _score_mod(self, cap: float) -> Callable | None:
        if cap <= 0:
            return None
        if cap not in self._score_mods:
            self._score_mods[cap] = soft_cap_score_mod(cap)
        return self._score_mods[cap]

    def _pool_kv(self, layer: LayerSpec, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys/values: [1, Hkv, S, D] views of the whole pool or the step's slots gathered, or
        (eager decode) [bs, Hkv, max_len, D] each request's own."""
        assert self.step is not None, "init_forward_metadata(batch) must run first"
        pool = batch.token_kv_pool
        k, v = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        if self.step.own_slots is not None:  # [bs, max_len, Hkv, D] -> [bs, Hkv, max_len, D]
            return k[self.step.own_slots].permute(0, 2, 1, 3), v[self.step.own_slots].permute(0, 2, 1, 3)
        assert self.step.layout is not None
        slots = self.step.layout.slots
        if slots is not None:
            k, v = k.index_select(0, slots), v.index_select(0, slots)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)

    def _attend(self, q: torch.Tensor, layer: LayerSpec, batch: ForwardBatch) -> torch.Tensor:
        assert self.step is not None, "init_forward_metadata(batch) must run first"
        keys, values = self._pool_kv(layer, batch)
        try:
            return self._flex[self.step.decode](q, keys, values, score_mod=self._score_mod(layer.logit_cap),
                                                block_mask=self.step.block_mask(layer.sliding_window),
                                                scale=layer.scaling, enable_gqa=layer.num_q_heads != layer.num_kv_heads)
        except Exception as exc:
            if self.compiled and compile_failure(exc):  # torch could not build the fused kernel: say so, not a trace
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise BackendUnavailableError(
                    f"attention backend flex_attention: compile=on could not compile flex attention with torch "
                    f"{torch.__version__} ({type(exc).__name__}: {first}); use --attention-backend-config "
                    "compile=off (the default) or --attention-backend triton") from exc
            raise

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(k, v, layer, batch)
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim)
        out = self._attend(q.transpose(0, 1).unsqueeze(0), layer, batch)  # [1, Hq, T, D]
        return out[0].transpose(0, 1).contiguous()

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(k, v, layer, batch)
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim)
        assert self.step is not None, "init_forward_metadata(batch) must run first"
        bs, pad = q.shape[0], self.step.batch_rows - q.shape[0]
        if pad:
            q = torch.cat([q, q.new_zeros((pad, *q.shape[1:]))])
        return self._attend(q.unsqueeze(2), layer, batch).squeeze(2)[:bs]  # [bs, Hq, 1, D] -> [bs, Hq, D]
