"""GRPO steps under DeepSpeed ZeRO-2, for the shared-prefix and micro-batch tests: in one launch,
for SHARED_PREFIX in (0, 1) x TRAIN_MICRO_BATCH in (0, 1, 2), a fresh engine from the same weights
takes one step on the same groups (rank 0 has 3, rank 1 has 2: unequal micro-batch counts). Rank 0
saves, per setting, the full averaged gradient, the weights after the step, and every rank's
pi_old_logps and mask.

    MODEL_PATH=tiny/ MU=2 deepspeed --num_gpus 2 tests/zero2_gradient.py out.pt
"""
import os
import sys
from collections import Counter

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402  (constants from the environment)
from features.fast_paths import completion_logps  # noqa: E402

QUESTIONS = [
    "What is {} + 5?",
    "Tom has {} apples and eats 4. How many?",
    "A box holds {} pens. How many in 3?",
]


def rank_groups(engine, tokenizer, rank, G=3):
    """Groups with prompts of different lengths and ragged completions, each rank its own (3 on rank
    0, 2 on the others), with reference log-probs near the policy's (random ones make k3 overflow),
    as in training."""
    groups = []
    for i, question in enumerate(QUESTIONS[: 3 if rank == 0 else 2]):
        text = grpo.build_prompt(tokenizer, question.format(rank + 2 + 9 * i))
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        g = torch.Generator().manual_seed(10 * rank + i)
        completions = torch.randint(100, 5000, (G, 6), generator=g)  # (G, T)
        mask = torch.ones(G, 6, dtype=torch.bool)
        mask[0, 4:] = mask[2, 2:] = False  # answers that ended early
        ids = torch.cat([torch.tensor(prompt).expand(G, -1), completions], 1)  # (G, P + T)
        with torch.no_grad():
            ref = completion_logps(
                engine,
                ids.to(engine.device),
                torch.ones_like(ids).to(engine.device),
                6,
                1.0,
                chunk=grpo.fast_paths.LOGP_CHUNK,
                from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
            )
        groups.append(
            (
                dict(
                    input_ids=ids,
                    completion_mask=mask,
                    advantages=torch.randn(G, generator=g),
                    scores=torch.zeros(G),  # on the wire with every group; no loss reads it here
                    ref_logps=ref.cpu() + 0.3 * torch.randn(G, 6, generator=g),
                ),
                {"plen": len(prompt)},
            )
        )
    return groups


def one_step():
    """A fresh engine, one optimizer step over micro_batches; (grads, weights after, pi_old_logps,
    mask)."""
    engine, tokenizer, *_ = grpo.setup_deepspeed()
    rank = torch.distributed.get_rank()
    parts = grpo.choose_parts().batches(engine, rank_groups(engine, tokenizer, rank),
                                        tokenizer.pad_token_id)
    m = Counter()  # train_step's step 6, without its optimizer step
    for i, part in enumerate(parts):
        engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
        loss, metrics = grpo.choose_parts().loss(engine, part)
        engine.backward(loss)
        m.update(metrics)
    grads = {name: safe_get_full_grad(p).cpu() for name, p in engine.module.named_parameters()}
    before = {
        name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()
    }
    engine.step()
    weights = {
        name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()
    }
    moved = max((weights[name] - w).abs().max().item() for name, w in before.items())
    real = [p for p in parts if p.share > 0]
    # (B, T)
    mine = {
        k: torch.cat([getattr(p, k).float().cpu() for p in real]) for k in ("pi_old_logps", "mask")
    }
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return dict(
        grads=grads,
        weights=weights,
        moved=moved,
        parts=len(parts),
        loss=m["loss"],
        **{k: torch.cat([e[k] for e in everyone]) for k in mine},
    )


def main():
    results = {}
    for shared in (0, 1):
        for micro in (0, 1, 2):
            grpo.fast_paths.SHARED_PREFIX, grpo.zero2.TRAIN_MICRO_BATCH = bool(shared), micro
            results[shared, micro] = one_step()
    if torch.distributed.get_rank() == 0:
        torch.save(results, sys.argv[-1])  # the last argument: the launcher adds --local_rank


if __name__ == "__main__":
    main()
