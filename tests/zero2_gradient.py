"""One GRPO backward under DeepSpeed ZeRO-2, for test_grpo_math's shared-prefix test: each rank
collates its own groups (prompts of different lengths), prepares the batch (gen_logps at MU > 1),
takes policy_loss and engine.backward; rank 0 saves the full averaged gradient, gen_logps and mask.

    MODEL_PATH=tiny/ MU=2 SHARED_PREFIX=1 deepspeed --num_gpus 2 tests/zero2_gradient.py out.pt
"""
import os
import sys
from collections import defaultdict

import torch
from deepspeed.utils import safe_get_full_grad

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402  (constants from the environment)
from grpo_common import completion_logps  # noqa: E402


def rank_groups(tokenizer, rank, G=3):
    """Two groups with prompts of different lengths and ragged completions; each rank its own."""
    groups = []
    for i, question in enumerate([f"What is {rank + 2} + 5?", f"Tom has {rank + 11} apples and eats 4. How many?"]):
        prompt = tokenizer(grpo.build_prompt(tokenizer, question), add_special_tokens=False).input_ids
        g = torch.Generator().manual_seed(10 * rank + i)
        completions = torch.randint(100, 5000, (G, 6), generator=g)  # (G, T)
        mask = torch.ones(G, 6, dtype=torch.bool)
        mask[0, 4:] = mask[2, 2:] = False  # answers that ended early
        tensors = dict(input_ids=torch.cat([torch.tensor(prompt).expand(G, -1), completions], 1),
                       completion_mask=mask, advantages=torch.randn(G, generator=g))
        groups.append((tensors, {"plen": len(prompt)}))
    return groups


def main():
    engine, tokenizer, *_ = grpo.setup_deepspeed()
    rank = torch.distributed.get_rank()
    batch = grpo.prepare_batch(engine, grpo.collate(rank_groups(tokenizer, rank), tokenizer.pad_token_id))
    with torch.no_grad():  # a reference near the policy, as in training (random ones make k3 overflow)
        ref = completion_logps(engine, batch["input_ids"], batch["attention_mask"], 6, 1.0, shared_prefix=False)
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(rank)).to(ref.device)  # (B, T)
    batch["ref_logps"] = ref + 0.3 * noise  # (B, T)
    engine.backward(grpo.policy_loss(engine, batch, defaultdict(float)))
    grads = {name: safe_get_full_grad(p).cpu() for name, p in engine.module.named_parameters()}
    gathered = {}
    for name in ("gen_logps", "mask"):
        parts = [torch.zeros_like(batch[name], dtype=torch.float) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, batch[name].float())
        gathered[name] = torch.cat(parts).cpu()  # (ranks * B, T)
    if rank == 0:
        torch.save({"grads": grads, **gathered}, sys.argv[-1])  # the last argument: the launcher adds --local_rank


if __name__ == "__main__":
    main()
