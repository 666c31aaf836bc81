"""The vLLM engine of grpo_ref_split.py against the trainer's own log-probs, in a process of its own
(an in-process engine initialises torch.distributed, which the test process must not have). Prints
one JSON line of measurements that tests/test_vllm.py asserts on.

    python tests/vllm_checks.py MODEL_FOLDER
"""
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo
from features import vllm_engine  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from features.evaluation import evaluate  # noqa: E402
from features.fast_paths import completion_logps  # noqa: E402
from features.lora import add_lora  # noqa: E402
from features.vllm_engine import push_weights, vllm_sample  # noqa: E402
from rewards import load_questions  # noqa: E402


def vllm_logps_of(llm, ids, plen):
    """vLLM's log-probs (T = 1) of each row's tokens after its first plen, read as
    prompt_logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids], params, use_tqdm=False
    )
    return torch.tensor(
        [
            [out.prompt_logprobs[t][int(row[t])].logprob for t in range(plen, len(row))]
            for out, row in zip(outs, ids)
        ]
    )  # (B, L - plen)


def main(path):
    from transformers import GenerationConfig

    grpo.NUM_PRE_Q, grpo.MAX_NEW_TOKENS = 4, 24
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(path, torch.device("cpu"))
    # The RNG streams themselves, not a seed: LLM(seed=...) reseeds torch and random, and
    # vllm_engine.start_engine must put both back where they were. The same draws are taken with no
    # engine started, then after starting one.
    torch.manual_seed(123)
    random.seed(123)
    expected = (torch.rand(4).tolist(), [random.random() for _ in range(4)])
    torch.manual_seed(123)
    random.seed(123)
    grpo.MODEL_PATH = path
    vllm_engine.USE_VLLM = True  # as the trainer runs with an engine: vLLM samples step 2
    llm = vllm_engine.start_engine(
        resolve_model_path(grpo.MODEL_PATH),
        0,
        model.dtype,
        eager=vllm_engine.VLLM_EAGER,
        gpu_memory=vllm_engine.VLLM_GPU_MEMORY,
        cpu_kv_gb=vllm_engine.VLLM_CPU_KV_GB,
    )
    report = {
        "rng_untouched": (torch.rand(4).tolist(), [random.random() for _ in range(4)]) == expected
    }
    questions = load_questions("arithmetic", 3)[:6]

    # Sampling: shapes, stops, and vLLM's log-probs of its own tokens against the trainer's at
    # TEMPERATURE.
    torch.manual_seed(1)
    r = grpo.generate(model, tokenizer, questions[:2], rollout=grpo.choose_parts().rollout,
                      gen_config=gen_config, eos_ids=eos_ids, llm=llm)
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)  # (B, P+T)
    attn = torch.cat([r.prompt_mask, torch.ones_like(r.completion_ids)], 1)  # (B, P+T)
    T = r.completion_ids.shape[1]
    trainer = completion_logps(
        model,
        ids,
        attn,
        T,
        grpo.TEMPERATURE,
        chunk=grpo.fast_paths.LOGP_CHUNK,
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )  # (B, T)
    mask = r.mask  # (B, T)
    ended = torch.isin(r.completion_ids, torch.tensor(eos_ids)).any(1)  # (B,)
    report.update(
        rows=r.completion_ids.shape[0],
        sampled_gap=(trainer - r.extra.vllm_logps)[mask].abs().max().item(),
        stopped_or_full=bool((ended | (mask.sum(1) == grpo.MAX_NEW_TOKENS)).all()),
        padding_after_stop=bool((r.completion_ids[~mask] == tokenizer.pad_token_id).all()),
        distinct_in_group=[
            len({tuple(x) for x in r.completion_ids[g * 4 : g * 4 + 4].tolist()}) for g in range(2)
        ],
    )
    torch.manual_seed(1)
    again = grpo.generate(model, tokenizer, questions[:2], rollout=grpo.choose_parts().rollout,
                      gen_config=gen_config, eos_ids=eos_ids, llm=llm).completion_ids
    torch.manual_seed(2)
    other = grpo.generate(model, tokenizer, questions[:2], rollout=grpo.choose_parts().rollout,
                      gen_config=gen_config, eos_ids=eos_ids, llm=llm).completion_ids
    report.update(
        same_seed_same_samples=torch.equal(again, r.completion_ids),
        other_seed_other_samples=not torch.equal(
            other[:, :T], r.completion_ids[:, : other.shape[1]]
        ),
    )

    # Greedy evaluation: vLLM's answers against transformers' greedy ones.
    enc = grpo.encode_prompts(tokenizer, questions)
    greedy_vllm, _ = vllm_sample(
        llm, enc, 1, 0.0, eos_ids, tokenizer.pad_token_id, grpo.MAX_NEW_TOKENS
    )
    greedy_hf = model.generate(
        **enc,
        generation_config=GenerationConfig(
            do_sample=False,
            max_new_tokens=grpo.MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos_ids,
        ),
    )[:, enc.input_ids.shape[1] :]
    texts = [tokenizer.batch_decode(x, skip_special_tokens=True) for x in (greedy_vllm, greedy_hf)]
    report["greedy_same_texts"] = sum(a == b for a, b in zip(*texts))
    report["greedy_questions"] = len(questions)
    held = load_questions("arithmetic", 4)[:40]  # more than evaluate's transformers batch of 16
    args = dict(
        tokenizer=tokenizer,
        encode=grpo.encode_prompts,
        decode=grpo.decode,
        score=grpo.choose_task().score,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        max_new_tokens=grpo.MAX_NEW_TOKENS,
    )
    report["eval_vllm"] = evaluate(model, held, llm=llm, **args)
    report["eval_transformers"] = evaluate(model, held, **args)

    # Weight push: a fixed completion, read by vLLM before and after the trainer's weights change.
    plen = r.prompt_ids.shape[1]
    fixed, fixed_attn = ids[:4], attn[:4]
    old = completion_logps(
        model,
        fixed,
        fixed_attn,
        T,
        1.0,
        chunk=grpo.fast_paths.LOGP_CHUNK,
        # (4, T) the weights vLLM holds
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    new = completion_logps(
        model,
        fixed,
        fixed_attn,
        T,
        1.0,
        chunk=grpo.fast_paths.LOGP_CHUNK,
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )  # (4, T)
    valid = mask[:4]
    gap = lambda a, b: (a - b)[valid].abs().max().item()  # noqa: E731
    before = vllm_logps_of(llm, fixed, plen)
    push_weights(llm, model)
    after = vllm_logps_of(llm, fixed, plen)
    report.update(
        old_vs_new=gap(old, new),
        before_push_vs_old=gap(before, old),
        after_push_vs_new=gap(after, new),
        after_push_vs_old=gap(after, old),
    )

    # LoRA: the engine gets the base with the adapters merged in (vLLM holds no peft model).
    lora = add_lora(
        model, rank=4, alpha=grpo.lora.LORA_ALPHA, targets=grpo.lora.LORA_TARGETS, seed=grpo.SEED
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter
    with_adapters = completion_logps(
        lora,
        fixed,
        fixed_attn,
        T,
        1.0,
        chunk=grpo.fast_paths.LOGP_CHUNK,
        from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
    )  # (4, T)
    push_weights(llm, lora)
    report.update(
        lora_vs_base=gap(with_adapters, new),
        after_lora_push=gap(vllm_logps_of(llm, fixed, plen), with_adapters),
    )

    # A push that fails stops the run with a clear message.
    class Broken(torch.nn.Module):
        def state_dict(self):
            return {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}

    try:
        push_weights(llm, Broken())
        report["failed_push"] = "no error"
    except SystemExit as e:
        report["failed_push"] = str(e)
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
