"""A variant: completions of several turns, one loop for the calculator's calls
(features/tools.py) and an environment's episodes (environments.py). The model writes until its
turn ends, at its EOS or where it closes a call inside its own turn (a stop text); the episode
replies with tokens that join the completion but are not the policy's (the tool's <result>, or the
environment's observation as the user's next turn), and the model goes on. A completion ends when
its episode is done (stopped, as the policy chose), out of turns or calls, or out of
max_new_tokens (both cut, not stopped).

    python -m pytest tests/test_tools.py tests/test_environments.py   # both play through here

An episode is any object with turn_of (where a sampled segment's turn ends) and reply (what the
episode answers to it): tools.CallEpisode, environments.ChatEpisode.
"""
import copy
from dataclasses import dataclass, field

import torch


@dataclass
class Reply:
    """An episode's answer to a finished turn."""
    ids: list = field(default_factory=list)  # tokens that join the completion, never the policy's
    done: bool = False  # the episode is over: the completion stopped as the policy chose
    over: bool = False  # out of turns or calls: the completion ends cut


def play_turns(sample, prompts, episodes, *, tokenizer, max_new_tokens, eos_ids, pad_id) -> dict:
    """One completion to each of `prompts` (token id lists), played with its episode (episodes[i]).
    sample(prefixes, budgets) -> one (token ids, log-probs or None) continuation per prefix.
    Returns completion_ids (B, T) padded with pad_id, vllm_logps (B, T) or None, policy_mask
    (B, T) True on the policy's own tokens (up to and including a sampled EOS; never a reply's or
    the padding), reply_mask (B, T) True on the replies' tokens, stopped (B,) True where the
    episode ended done.

    The mask comes from each completion's real length, not from the first pad: the pad id is the
    EOS for SmolLM2 and Qwen, and a completion cut after a reply has none, so a first-pad rule
    would train on a token never sampled."""
    B = len(prompts)
    ids = [[] for _ in range(B)]
    own = [[] for _ in range(B)]  # True on the policy's tokens
    logps = [[] for _ in range(B)]
    stopped = [False] * B
    sampled = False
    active = list(range(B))
    while active:
        outs = sample([prompts[i] + ids[i] for i in active],
                      [max_new_tokens - len(ids[i]) for i in active])
        still = []
        for i, (segment, segment_logps) in zip(active, outs):
            segment = list(segment)[: max_new_tokens - len(ids[i])]
            segment, ended = episodes[i].turn_of(tokenizer, segment, eos_ids)
            sampled |= segment_logps is not None
            ids[i] += segment
            own[i] += [True] * len(segment)
            logps[i] += list(segment_logps or [0.0] * len(segment))[: len(segment)]
            if ended is None:
                continue  # cut by the budget: the episode ends unfinished
            reply = episodes[i].reply(tokenizer, ids[i], segment, ended=ended,
                                      budget_left=max_new_tokens - len(ids[i]))
            if reply.done:
                stopped[i] = True
                continue
            if reply.over:
                continue  # out of turns or calls: cut, as the budget cuts
            joined = reply.ids[: max_new_tokens - len(ids[i])]
            ids[i] += joined
            own[i] += [False] * len(joined)
            logps[i] += [0.0] * len(joined)
            if len(ids[i]) < max_new_tokens:
                still.append(i)
        active = still
    vllm_logps = padded_rows(logps, 0.0, torch.float32)  # (B, T)
    return dict(completion_ids=padded_rows(ids, pad_id, torch.long),  # (B, T)
                vllm_logps=vllm_logps if sampled else None,
                policy_mask=padded_rows(own, False, torch.bool),  # (B, T)
                reply_mask=padded_rows([[not o for o in row] for row in own], False,
                                       torch.bool),  # (B, T)
                stopped=torch.tensor(stopped))  # (B,)


def prompts_and_sampler(model, tokenizer, enc, n, *, gen_config, llm, temperature, eos_ids,
                        stop) -> tuple:
    """(each completion's prompt as a token id list, n per prompt of `enc` (left-padded input_ids,
    attention_mask), sample() for play_turns from vLLM (`llm`) or transformers' generate with
    gen_config), each turn stopping at an EOS or a text of `stop`."""
    rows = [ids[keep.bool()].tolist()
            for ids, keep in zip(enc.input_ids.cpu(), enc.attention_mask.cpu())]
    prompts = [p for p in rows for _ in range(n)]
    if llm is not None:
        return prompts, vllm_turns(llm, temperature, eos_ids, stop=stop)
    return prompts, transformers_turns(model, tokenizer, gen_config, stop=stop)


def eos_at(segment, eos_ids):
    """The index of the first EOS in segment, or None."""
    return next((k for k, t in enumerate(segment) if t in eos_ids), None)


def padded_rows(rows, pad, dtype) -> torch.Tensor:
    """(B, T) of B lists of different lengths, each padded on the right with `pad` to the longest
    (T at least 1)."""
    width = max(1, max(map(len, rows)))
    out = torch.full((len(rows), width), pad, dtype=dtype)  # (B, T)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def transformers_turns(model, tokenizer, gen_config, stop=()):
    """sample() for play_turns from transformers' generate: the prefixes left-padded into one
    batch, each row stopping at an EOS or at a text of `stop` (generate's stop_strings; () = at an
    EOS only, an environment's turn)."""

    def sample(prefixes, budgets):
        width = max(map(len, prefixes))
        device = next(model.parameters()).device
        ids = torch.tensor([[gen_config.pad_token_id] * (width - len(p)) + p for p in prefixes],
                           device=device)  # (b, width)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes],
                            device=device)  # (b, width)
        config = copy.deepcopy(gen_config)  # the trainer's sampling, stopping at a call too
        config.max_new_tokens = max(budgets)
        config.stop_strings = list(stop) or None
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config,
                             tokenizer=tokenizer)
        return [(row.tolist(), None) for row in out[:, width:].cpu()]

    return sample


def vllm_turns(llm, temperature, eos_ids, stop=()):
    """sample() for play_turns from a vLLM engine: one request per prefix, stopping at an EOS or a
    text of `stop`, with the sampled tokens' log-probs; a continuation's prefix is in the engine's
    prefix cache already."""
    from vllm.inputs import TokensPrompt

    from features.vllm_engine import sampled_logps, sampling_params

    def sample(prefixes, budgets):
        seeds = [None] * len(prefixes)  # greedy
        if temperature > 0:
            seeds = torch.randint(2**31, (len(prefixes),)).tolist()
        params = [sampling_params(temperature, budget, eos_ids, seed, stop=list(stop),
                                  include_stop_str_in_output=True)
                  for budget, seed in zip(budgets, seeds)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes], params,
                            use_tqdm=False)
        completions = [out.outputs[0] for out in outs]
        return [(list(a.token_ids), sampled_logps(a) if a.logprobs else None) for a in completions]

    return sample
