"""vLLM with images (USE_VLLM on a vision-language model) against the trainer's own log-probs, in a
process of its own (an in-process engine initialises torch.distributed, which the test process must
not have). Prints one JSON line of measurements that tests/test_vision.py asserts on.

    python tests/vllm_vision_checks.py MODEL_FOLDER   # an Idefics3 folder (features/vision_demo.py)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_ref_split as grpo  # noqa: E402
import rewards  # noqa: E402
from features import vision, vllm_engine  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402


def vllm_logps_of(llm, marked_ids, images, answers, mask):
    """vLLM's log-probs (T = 1) of each row's answer tokens (those in mask), read as prompt_logprobs
    of the prompt (its ids with one mark per image, and its images) followed by the answer.
    marked_ids, images: one per row; answers, mask (B, T). Returns (B, T), 0 off the mask."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    kept = [row[keep].tolist() for row, keep in zip(answers, mask)]
    prompts = [TokensPrompt(prompt_token_ids=ids + answer, multi_modal_data={"image": pictures})
               for ids, pictures, answer in zip(marked_ids, images, kept)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    logps = torch.zeros(answers.shape)  # (B, T)
    for row, (out, answer) in enumerate(zip(outs, kept)):
        start = len(out.prompt_token_ids) - len(answer)  # the prompt as vLLM expanded it
        found = [out.prompt_logprobs[start + t][token].logprob for t, token in enumerate(answer)]
        logps[row, : len(found)] = torch.tensor(found)
    return logps


def main(path):
    grpo.NUM_PRE_Q = 4
    grpo.MAX_NEW_TOKENS = 12
    grpo.MODEL_PATH = path
    vllm_engine.USE_VLLM = True  # as the trainer runs with an engine: vLLM samples step 2
    model, tokenizer, eos_ids, gen_config = grpo.load_policy(path, torch.device("cpu"))
    llm = vllm_engine.start_engine(resolve_model_path(grpo.MODEL_PATH), 0, model.dtype,
                                   eager=vllm_engine.VLLM_EAGER,
                                   gpu_memory=vllm_engine.VLLM_GPU_MEMORY,
                                   cpu_kv_gb=vllm_engine.VLLM_CPU_KV_GB)
    questions = rewards.make_shapes(6, seed=3)
    report = {}

    # Sampling with images: vLLM's log-probs of its own tokens against the trainer's at TEMPERATURE,
    # with the pixels the Rollout carries (vllm_sample has checked that its prompt ids are ours).
    torch.manual_seed(1)
    r = grpo.generate(model, tokenizer, questions[:2], rollout=grpo.choose_parts().rollout,
                      gen_config=gen_config, eos_ids=eos_ids, llm=llm)
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)  # (B, P+T)
    attn = torch.cat([r.prompt_mask, torch.ones_like(r.completion_ids)], 1)  # (B, P+T)
    T = r.completion_ids.shape[1]
    trainer = grpo.per_token_logps(model, ids, attn, T,
                                   **r.extra.vision_inputs)  # (B, T) at TEMPERATURE
    mask = r.mask.bool()  # (B, T)
    report.update(rows=r.completion_ids.shape[0], sampled_tokens=int(mask.sum()),
                  pixel_rows=int(r.extra.vision_inputs["pixel_values"].shape[0]),
                  sampled_gap=(trainer - r.extra.vllm_logps)[mask].abs().max().item(),
                  distinct_in_group=[len({tuple(x) for x in r.completion_ids[g * 4: g * 4 + 4]
                                          .tolist()}) for g in range(2)])

    # The images reach vLLM: the same answers read with each row's own images, and with the
    # other question's, against the trainer's at T = 1 with the same pixels.
    enc = grpo.encode_prompts(tokenizer, questions[:2])
    marked = [ids_ for ids_ in enc["marked_ids"] for _ in range(4)]
    own = [pictures for pictures in enc["images"] for _ in range(4)]
    swapped = own[4:] + own[:4]
    grpo.TEMPERATURE = 1.0

    def trainer_logps(pixels):
        return grpo.per_token_logps(model, ids, attn, T, **pixels)  # (B, T)

    def gap(a, b):
        return (a - b)[mask].abs().max().item()

    pixels = r.extra.vision_inputs
    swapped_pixels = {name: torch.cat([value[4:], value[:4]]) for name, value in pixels.items()}
    report.update(own_images=gap(vllm_logps_of(llm, marked, own, r.completion_ids, mask),
                                 trainer_logps(pixels)),
                  swapped_images=gap(vllm_logps_of(llm, marked, swapped, r.completion_ids, mask),
                                     trainer_logps(swapped_pixels)),
                  images_move_logps=gap(trainer_logps(pixels), trainer_logps(swapped_pixels)))

    # Weight pushes: the vision side (tower and connector) moved alone, then the language model
    # alone; vLLM reads the fixed answers before and after each push.
    def perturb(language: bool):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ("text_model" in name or "lm_head" in name) == language:
                    p.add_(torch.randn_like(p) * 0.05)

    torch.manual_seed(5)
    for side, language in (("vision", False), ("language", True)):
        old = trainer_logps(pixels)
        perturb(language)
        new = trainer_logps(pixels)
        before = vllm_logps_of(llm, marked, own, r.completion_ids, mask)
        vllm_engine.push_weights(llm, model)
        after = vllm_logps_of(llm, marked, own, r.completion_ids, mask)
        report[side] = dict(old_vs_new=gap(old, new), before_push_vs_old=gap(before, old),
                            after_push_vs_new=gap(after, new))

    # LoRA on the language model: the engine gets the base with the adapters merged in.
    from features.lora import add_lora

    base = trainer_logps(pixels)  # (B, T) before peft wraps the model's layers in place
    lora = add_lora(model, rank=4, alpha=grpo.lora.LORA_ALPHA, targets="all-linear", seed=0,
                    quiet=True)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter
    with_adapters = grpo.per_token_logps(lora, ids, attn, T, **pixels)  # (B, T)
    vllm_engine.push_weights(llm, lora)
    report.update(
        lora_vs_base=gap(with_adapters, base),
        after_lora_push=gap(vllm_logps_of(llm, marked, own, r.completion_ids, mask), with_adapters),
    )
    model = lora.unload()  # the base model again, adapters dropped, for what follows
    vllm_engine.push_weights(llm, model)

    # Greedy answers with images: vLLM's (as the evaluation asks) against transformers'.
    grpo.TEMPERATURE = 0.7
    enc = grpo.encode_prompts(tokenizer, questions)
    greedy_vllm, _ = vllm_engine.vllm_sample(
        llm, enc, 1, 0.0, eos_ids, tokenizer.pad_token_id, grpo.MAX_NEW_TOKENS, seeded=False
    )
    from transformers import GenerationConfig

    greedy_hf = model.generate(
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        **vision.pixel_rows(enc, 1),
        generation_config=GenerationConfig(
            do_sample=False,
            max_new_tokens=grpo.MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos_ids,
        ),
    )
    texts = [
        tokenizer.batch_decode(x, skip_special_tokens=True)
        for x in (greedy_vllm, greedy_hf[:, enc.input_ids.shape[1] :])
    ]
    report.update(
        greedy_same_texts=sum(a == b for a, b in zip(*texts)), greedy_questions=len(questions)
    )

    # A processor that expands the image marks otherwise than the trainer's is caught.
    enc["marked_ids"] = [ids_ + ids_[-1:] for ids_ in enc["marked_ids"]]
    try:
        vllm_engine.vllm_sample(llm, enc, 1, 0.0, eos_ids, tokenizer.pad_token_id, 4, seeded=False)
        report["other_expansion"] = "no error"
    except RuntimeError as e:
        report["other_expansion"] = str(e)
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
