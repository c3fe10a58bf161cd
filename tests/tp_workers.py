"""Worker functions for the tensor-parallel tests: run in spawned ranks (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import torch

from sglx.distributed.group import destroy_distributed, init_distributed
from sglx.llm.engine_config import EngineConfig
from sglx.llm.forward_batch import ForwardBatch, ForwardMode


def runner_config(model_path: str, device: str = "cpu", tp_size: int = 1, backend: str = "torch_native",
                  dtype: str = "float32") -> EngineConfig:
    return EngineConfig(model_path=model_path, device=device, dtype=dtype, attention_backend=backend,
                        max_total_tokens=256, max_running_requests=4, tp_size=tp_size, disable_cuda_graph=True)


def prompt_logits(runner, prompt: list[int], next_token: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(logits of every prompt token after one EXTEND, logits of one DECODE step of `next_token`), float32 CPU.

    The request sits in row 1 on KV slots 1..n+1 (slot 0 is the padding slot), so the decode step reads the
    prompt's K/V back from this rank's own pool.
    """
    n, dev = len(prompt), runner.device
    table = runner.req_to_token_pool.req_to_token
    table[1, :n + 1] = torch.arange(1, n + 2, device=table.device, dtype=table.dtype)
    extend = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.tensor(prompt, device=dev), positions=torch.arange(n, device=dev),
        req_pool_indices=torch.tensor([1], device=dev), seq_lens=torch.tensor([n], device=dev),
        out_cache_loc=torch.arange(1, n + 1, device=dev), req_to_token_pool=runner.req_to_token_pool,
        token_kv_pool=runner.token_kv_pool, seq_lens_cpu=[n], extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[0],
        return_all_logits=True)
    first = runner.forward(extend)
    decode = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.tensor([next_token], device=dev),
        positions=torch.tensor([n], device=dev), req_pool_indices=torch.tensor([1], device=dev),
        seq_lens=torch.tensor([n + 1], device=dev), out_cache_loc=torch.tensor([n + 1], device=dev),
        req_to_token_pool=runner.req_to_token_pool, token_kv_pool=runner.token_kv_pool, seq_lens_cpu=[n + 1])
    second = runner.forward(decode)
    return first.float().cpu(), second.float().cpu()


def tp_logits_worker(rank: int, world_size: int, model_paths: list[str], prompt: list[int], next_token: int,
                     device: str, backend: str, platform: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank builds its shard of every model (tp = world_size) and returns its (extend, decode) logits.

    platform: the parent's PlatformSnapshot (probing every kernel package again costs seconds per rank)."""
    from sglx.llm.model_runner import ModelRunner

    torch.set_num_threads(1)
    ctx = init_distributed(rank, world_size, device=device if device == "cpu" else f"cuda:{rank}")
    out = []
    with torch.inference_mode():
        for path in model_paths:
            runner = ModelRunner(runner_config(path, device, world_size, backend), dist=ctx,
                                 platform_snapshot=platform)  # type: ignore[arg-type]
            out.append(prompt_logits(runner, prompt, next_token))
            runner.release_memory()
    destroy_distributed()
    return out


def raise_mid_run_worker(rank: int, world_size: int) -> int:
    """Both ranks run one all-reduce; then rank 1 raises while rank 0 waits in the next one for it."""
    ctx = init_distributed(rank, world_size)
    t = torch.ones(1, device=ctx.device)
    ctx.all_reduce(t)
    if rank == 1:
        raise ValueError("rank 1 gave up on purpose\nsecond line not shown")
    ctx.all_reduce(t)
    return int(t.item())


def torchrun_style_generate(rank: int, world_size: int, args: list[str], platform: object) -> tuple[int, str]:
    """`sglx generate ARGS` in a rank started with torchrun's environment (RANK, WORLD_SIZE, MASTER_*), as
    `torchrun --nproc-per-node 2 -m sglx generate ... --tp 2` runs it: rank 0 prints, rank 1 serves and exits.

    The parent's platform snapshot stands in for rank 0's package probe (seconds of imports per process)."""
    from typer.testing import CliRunner

    import sglx.platform
    from sglx.cli.app import app

    torch.set_num_threads(1)
    sglx.platform.current = lambda probe_packages=True: platform  # type: ignore[assignment]
    result = CliRunner().invoke(app, ["generate", *args])
    return result.exit_code, result.stdout


def torchrun_generate_then_logits(rank: int, world_size: int, cli_args: list[str], platform: object,
                                  model_paths: list[str], prompt: list[int], next_token: int,
                                  logits_port: int) -> tuple[int, str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Both checks in one pair of processes (each costs seconds of start-up): `sglx generate` under torchrun's
    variables, then, in a second group on another port, the model-level logits of `tp_logits_worker`."""
    import os

    code, out = torchrun_style_generate(rank, world_size, cli_args, platform)
    os.environ["MASTER_PORT"] = str(logits_port)
    return code, out, tp_logits_worker(rank, world_size, model_paths, prompt, next_token, "cpu", "torch_native",
                                       platform)
