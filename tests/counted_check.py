"""Run under torchrun by tests/test_hf.py: one micro-step of an hf job on instruction
data (a loss mask) with ``train.logits: counted`` and again with every position, on the
same weights and batch, then one micro-step whose targets are all prompt. Rank 0 prints
one JSON line: the rows the output head ran on (each rank's), the tokens counted, both
losses, the largest gradient difference, and the prompt-only step's loss and largest
gradient.

    python -m torch.distributed.run --nproc-per-node 2 tests/counted_check.py JOB.yaml
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor (FSDP2, TP): the whole tensor
    return (full() if full else t).detach().clone()


def main(config: str) -> int:
    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import all_reduce_sum, init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.local import LocalBatches
    from raytrain_platform.resolve import resolve_job

    torch.set_num_threads(1)
    cfg = load_config(config, [f"scaling.num_workers={os.environ.get('WORLD_SIZE', '1')}"])
    env = init_torchrun(use_gpu=False)
    job = resolve_job(cfg)
    engine = Engine(job, env)
    head = engine.head
    assert head is not None, "train.logits counted found no output head"
    source = LocalBatches(job, rank=engine.data_rank, world_size=engine.data_world)
    batch = engine._to_device(next(iter(source.train_epoch(0))))
    counted = engine.task.num_targets(engine.task.split(batch)[1])
    rows: list[int] = []
    hook = head.register_forward_hook(lambda m, a, out: rows.append(int(_full(out).shape[0])))
    scale = engine.loss_scale([batch])
    results = {}
    for mode in ("counted", "all"):
        engine.head = head if mode == "counted" else None
        loss = engine.micro_step(batch, sync=True, scale=scale)
        results[mode] = (float(all_reduce_sum(loss.clone())),
                         {n: _full(p.grad) for n, p in engine.wrapped.base.named_parameters() if p.grad is not None})
        engine.optimizer.zero_grad(set_to_none=True)
    # A micro-batch whose targets are all prompt: the head runs on no row (under TP a
    # zero-row input crosses the ranks), the loss is 0 and so is every gradient.
    engine.head = head
    prompt_only = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    zero_loss = float(all_reduce_sum(engine.micro_step(prompt_only, sync=True, scale=1.0).clone()))
    zero_grad = max(float(_full(p.grad).abs().max()) for p in engine.wrapped.base.parameters() if p.grad is not None)
    engine.optimizer.zero_grad(set_to_none=True)
    hook.remove()
    (loss_c, grads_c), (loss_a, grads_a) = results["counted"], results["all"]
    assert grads_c.keys() == grads_a.keys() and grads_c, "gradients missing"
    diff = max(float((grads_c[n] - grads_a[n]).abs().max() / grads_a[n].abs().max().clamp(min=1e-12))
               for n in grads_c)
    gathered = [None] * env.world_size if dist.is_initialized() else None
    mine = {"rank": env.rank, "head_rows": rows, "counted": counted, "positions": int(batch["tokens"][:, 1:].numel())}
    if gathered is not None:
        dist.all_gather_object(gathered, mine)
    if env.is_rank0:
        print(json.dumps({"ranks": gathered or [mine], "loss_counted": loss_c, "loss_all": loss_a,
                          "max_grad_rel_diff": diff, "prompt_only_loss": zero_loss,
                          "prompt_only_max_grad": zero_grad}))
    if dist.is_initialized():
        dist.barrier()  # every rank done (rank 0 printed) before any tears its groups down
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
