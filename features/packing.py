"""Faster equal: padding-free forwards (PADDING_FREE), each row's real tokens packed end to end, no
forward or backward spent on padding; tested equal to the padded rectangle (tests/test_packing.py).

A Batch is a rectangle: prompts left-padded to the longest, answers right-padded to the longest.
Here each row keeps only the tokens its attention_mask marks (its prompt and its answer up to the
last token that trains, as collate and the server lay them out), rows are laid end to end in
packed rows of at most PACK_TOKENS tokens, and position ids restart at 0 for each row. With the
2-D attention mask left out, transformers reads the restarts as sequence boundaries: sdpa and
eager attention get a block-causal mask (no token sees another row's), flash-attention its
variable-length kernel (cu_seqlens from the same position ids). With SHARED_PREFIX the group's
prompt still runs once: its KV cache is computed on one row, and the group's answers run packed
after it, each answer seeing the prompt and its own earlier tokens (a 4-D mask of
prompt-then-block-causal; flash-attention has no such mask, so there the answers use sdpa's).

What it costs: attention inside a packed row is computed over the whole row and masked, so its
work grows with PACK_TOKENS squared while the layers' matmuls shrink by the padding removed; a
bound of a few thousand tokens keeps the masked attention small beside the matmuls of a small
model (docs/padding_free.md has the table of where it pays).

    python bench/bench_padding_free.py   # step seconds and peak memory, packed and padded
"""
import contextlib
import sys

import torch

from features import env_overrides

PADDING_FREE = False  # True = rows packed end to end, no padding computed; False = rectangles
PACK_TOKENS = 4096  # tokens in one packed row at most; its masked attention grows as its square
env_overrides.apply_env_overrides(globals(), "features/packing.py")


def check_settings(*, images: bool) -> None:
    """Refuse, before any model loads, what cannot pack: a vision-language model's rows (its image
    tokens take positions from the pixels' grid, in rectangles of whole rows)."""
    if PADDING_FREE and images:
        sys.exit("PADDING_FREE = True with a vision-language model: its image tokens' positions "
                 "come from each image's grid, which packed rows with restarting position ids "
                 "cannot give; set PADDING_FREE=0")


def row_spans(attention_mask: torch.Tensor, n_completion: int) -> list:
    """[(start, end)] per row: the columns its attention_mask marks, one run of ones ending at or
    after the answer's first column (L - n_completion). ValueError where a row cannot pack: a hole
    in its mask (it would see tokens a packed row cannot show it), or no prompt token."""
    L = attention_mask.shape[1]
    first_answer = L - n_completion  # every answer starts at this column (prompts left-padded)
    marked = attention_mask.bool()  # (B, L)
    count = marked.sum(1)  # (B,)
    start = marked.int().argmax(1)  # (B,) the first marked column
    spans = []
    for row, (s, n) in enumerate(zip(start.tolist(), count.tolist())):
        end = s + n
        if n and not marked[row, s:end].all():
            raise ValueError(f"row {row}'s attention mask has a hole: PADDING_FREE packs one run "
                             "of tokens per row (left-padded prompt, right-padded answer)")
        if n == 0 or s >= first_answer:
            raise ValueError(f"row {row} has no prompt token: its first answer token has "
                             "nothing to be predicted from")
        spans.append((s, max(end, first_answer)))
    return spans


def packed_rows(lengths: list, limit: int) -> list:
    """Rows in order, as lists of row indices whose lengths add up to at most `limit` (a row
    longer than the limit alone in its own)."""
    out = []
    total = limit + 1  # no open packed row yet
    for row, length in enumerate(lengths):
        if total + length > limit:
            out.append([])
            total = 0
        out[-1].append(row)
        total += length
    return out


def packed_states(model, input_ids, attention_mask, n_completion: int, *, hidden: bool,
                  limit: int = 0) -> torch.Tensor:
    """(B, n_completion, V) logits, or with hidden=True (B, n_completion, H) last hidden states,
    where [:, t] predicts input_ids[:, -n_completion + t]: the padded forward's values on every
    answer token the attention_mask marks, 0 past each row's end. The rows run packed (above),
    `limit` tokens a packed row (0 = PACK_TOKENS)."""
    from features.fast_paths import lm_head_weight, model_outputs  # here: a cycle
    B, L = input_ids.shape
    first_answer = L - n_completion
    spans = row_spans(attention_mask, n_completion)
    answered = [r for r in range(B) if spans[r][1] > first_answer]  # rows with a token to predict
    weight = lm_head_weight(model)  # (V, H)
    width = weight.shape[1] if hidden else weight.shape[0]
    out = weight.new_zeros(B, n_completion, width)  # (B, T, D) 0 where nothing is predicted
    lengths = [spans[r][1] - spans[r][0] for r in answered]
    for packed in packed_rows(lengths, limit or PACK_TOKENS):
        rows = [answered[i] for i in packed]
        pieces = [input_ids[r, spans[r][0] : spans[r][1]] for r in rows]  # each (n_r,)
        ids = torch.cat(pieces)[None]  # (1, N)
        positions = torch.cat([torch.arange(len(p), device=ids.device) for p in pieces])[None]
        keep, at_row, at_column = [], [], []  # packed positions that predict, and where they go
        offset = 0
        for r, piece in zip(rows, pieces):
            answer = spans[r][1] - first_answer  # the row's answer tokens
            predicting = offset + first_answer - spans[r][0] - 1 + torch.arange(answer)  # (a,)
            keep.append(predicting)
            at_row += [r] * answer
            at_column += range(answer)
            offset += len(piece)
        keep = torch.cat(keep).to(ids.device)  # (K,)
        # No cache: transformers reads the restarts as boundaries only without one
        states = model_outputs(model, hidden, keep, input_ids=ids, position_ids=positions,
                               use_cache=False)[0]  # (K, D)
        index = (torch.tensor(at_row, device=ids.device),
                 torch.tensor(at_column, device=ids.device))
        out = out.index_put(index, states.to(out.dtype))  # (B, T, D) out of place: grads flow
    return out


def shared_prompt_mask(plen: int, answer_lengths: list, device) -> torch.Tensor:
    """(1, 1, N, plen + N) bool, N = the answers' tokens: each answer token sees the whole prompt
    (its KV cache) and its own answer's tokens up to itself, never another answer's."""
    n = sum(answer_lengths)
    owner = torch.repeat_interleave(torch.arange(len(answer_lengths), device=device),
                                    torch.tensor(answer_lengths, device=device))  # (N,)
    at = torch.arange(n, device=device)  # (N,)
    same = (owner[:, None] == owner[None, :]) & (at[None, :] <= at[:, None])  # (N, N)
    prompt = torch.ones(n, plen, dtype=torch.bool, device=device)  # (N, plen)
    return torch.cat([prompt, same], 1)[None, None]  # (1, 1, N, plen + N)


def group_states(model, input_ids, attention_mask, n_completion: int,
                 hidden: bool = False) -> torch.Tensor:
    """shared_prefix_logits' values for G rows with one prompt, padding-free: the prompt runs
    once (its KV cache, one row), then the group's answers packed in one row after it
    (shared_prompt_mask). (G, t, V or H), t the group's longest answer; 0 past each row's end."""
    from features.fast_paths import (_check_cache, checkpointing, layer_flags,  # here: a cycle
                                     model_outputs, prompt_cache)
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if str(inner.config._attn_implementation).startswith("flash"):
        raise ValueError("flash-attention takes no 4-D mask, which the shared prompt's packed "
                         "answers need: SHARED_PREFIX=0 with PADDING_FREE on this model")
    G, L = input_ids.shape
    first_answer = L - n_completion
    spans = row_spans(attention_mask, n_completion)
    answers = [end - first_answer for _, end in spans]  # each row's answer tokens
    prompt = input_ids[:1, spans[0][0] : first_answer]  # (1, plen) the group's one prompt
    plen = prompt.shape[1]
    cache, first = prompt_cache(model, prompt, torch.ones_like(prompt), 1, hidden)  # (1, 1, D)
    device = first.device
    out = first.new_zeros(G, max(max(answers), 1), first.shape[-1])  # (G, t, D)
    answered = [r for r in range(G) if answers[r]]  # rows with a token to predict
    out = out.index_put((torch.tensor(answered, dtype=torch.long, device=device),
                         torch.zeros(len(answered), dtype=torch.long, device=device)),
                        first[0].expand(len(answered), -1))  # token 0: the prompt's last position
    fed = [max(a - 1, 0) for a in answers]  # answer tokens that predict the next one
    if not sum(fed):
        return out
    ids = torch.cat([input_ids[r, first_answer : first_answer + fed[r]] for r in range(G)])[None]
    positions = torch.cat([plen + torch.arange(n, device=ids.device) for n in fed])[None]  # (1, N)
    switch = contextlib.nullcontext()  # no layer recomputes: its flags need no switching
    if checkpointing(inner):
        switch = layer_flags(inner, _can_checkpoint_with_cache=True)
    with switch:
        rest = model_outputs(model, hidden, 0, input_ids=ids, past_key_values=cache,
                             position_ids=positions,
                             attention_mask=shared_prompt_mask(plen, fed, ids.device))[0]  # (N, D)
    _check_cache(cache, plen + ids.shape[1], inner)
    cache.crop(plen)  # back to the prompt: checkpointed layers recompute on it in backward
    at_row = [r for r, n in enumerate(fed) for _ in range(n)]
    at_column = [column for n in fed for column in range(1, n + 1)]
    index = (torch.tensor(at_row, device=device), torch.tensor(at_column, device=device))
    return out.index_put(index, rest)  # (G, t, D)
