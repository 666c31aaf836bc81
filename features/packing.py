"""Faster equal: padding-free forwards (PADDING_FREE), each row's real tokens packed end to end, no
forward or backward spent on padding; tested equal to the padded rectangle (tests/test_packing.py).

A Batch is a rectangle: prompts left-padded to the longest, completions right-padded to the
longest. Here each row keeps only the tokens its attention_mask marks (its prompt and its
completion up to the last token that trains, as collate and the server lay them out). The rows go,
longest first, into packed rows no longer than the batch's longest row (PACK_TOKENS: another
bound), each into the first with room, and position ids restart at 0 for each row. With the 2-D
attention mask left out, transformers reads the restarts as sequence boundaries: sdpa and eager
attention get a block-causal mask (no token sees another row's), flash-attention its
variable-length kernel (cu_seqlens from the same position ids). With SHARED_PREFIX the group's
prompt still runs once: its KV cache, then the group's completions packed the same way after it,
each completion seeing the prompt and its own earlier tokens (a 4-D mask; flash-attention takes
none, so it is refused there).

What it costs: attention inside a packed row is computed over the whole row and masked. A packed
row no longer than the longest row keeps that work at most the rectangle's (fewer rows of the
same length); the matmuls shrink by the padding left out, less the packed rows' own slack (the
tail of a packed row the next row did not fit in). docs/padding_free.md has the table of where it
pays.

    python bench/bench_padding_free.py   # step seconds and peak memory, packed and padded
"""
import contextlib
import sys
from dataclasses import dataclass

import torch

from features import env_overrides

PADDING_FREE = False  # True = rows packed end to end, no padding computed; False = rectangles
PACK_TOKENS = 0  # tokens in a packed row at most; 0 = the batch's longest row (attention <= padded)
env_overrides.apply_env_overrides(globals(), "features/packing.py")


def check_settings(*, images: bool) -> None:
    """Refuse, before any model loads, what cannot pack: a vision-language model's rows (its image
    tokens take positions from the pixels' grid, in rectangles of whole rows)."""
    if PADDING_FREE and images:
        sys.exit("PADDING_FREE = True with a vision-language model: its image tokens' positions "
                 "come from each image's grid, which packed rows with restarting position ids "
                 "cannot give; set PADDING_FREE=0")


def attention_implementation(device, *, padding_free: bool, shared_prefix: bool) -> str | None:
    """The attention a model loads with: flash-attention 2 where rows pack (padding_free) on a CUDA
    device with flash_attn installed and no 4-D mask is needed (shared_prefix off), its
    variable-length kernel running the packed rows with no mask at all; else None, transformers'
    default (sdpa), which builds the block-causal mask from the restarting position ids."""
    from importlib.util import find_spec

    on_gpu = torch.device(device).type == "cuda"
    if not padding_free or shared_prefix or not on_gpu:
        return None
    if find_spec("flash_attn") is None:  # pip install flash-attn: not a requirement
        return None
    return "flash_attention_2"


def row_spans(attention_mask: torch.Tensor, n_completion: int) -> list:
    """[(start, end)] per row: the columns its attention_mask marks, one run of ones ending at or
    after the completion's first column (L - n_completion). ValueError where a row cannot pack: a
    hole in its mask (it would see tokens a packed row cannot show it), or no prompt token."""
    L = attention_mask.shape[1]
    first_completion = L - n_completion  # every completion starts here (prompts left-padded)
    marked = attention_mask.bool()  # (B, L)
    count = marked.sum(1)  # (B,)
    start = marked.int().argmax(1)  # (B,) the first marked column
    spans = []
    for row, (s, n) in enumerate(zip(start.tolist(), count.tolist())):
        end = s + n
        if n and not marked[row, s:end].all():
            raise ValueError(f"row {row}'s attention mask has a hole: PADDING_FREE packs one run "
                             "of tokens per row (left-padded prompt, right-padded completion)")
        if n == 0 or s >= first_completion:
            raise ValueError(f"row {row} has no prompt token: its first completion token has "
                             "nothing to be predicted from")
        spans.append((s, max(end, first_completion)))
    return spans


def first_fit(lengths: list, capacity: int) -> list:
    """Indices of `lengths` in bins whose lengths add up to at most `capacity`, longest first,
    each into the first bin with room (first-fit decreasing); one longer than capacity alone."""
    bins = []  # [(room left, [indices])]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, (room, members) in enumerate(bins):
            if lengths[i] <= room:
                bins[b] = (room - lengths[i], members + [i])
                break
        else:
            bins.append((capacity - lengths[i], [i]))
    return [members for _, members in bins]


@dataclass
class Packed:
    """Rows laid end to end in k packed rows of `width` tokens; the tail after a packed row's last
    row is its own run of pad tokens (its positions restart too, so it is its own sequence)."""
    ids: torch.Tensor  # (k, width) the tokens
    positions: torch.Tensor  # (k, width) each row's from `start` up; the tail's from `start` too
    owner: torch.Tensor  # (k, width) which run of tokens each belongs to (a row, or a tail)
    at: list  # [(packed row, column)] of each row's first token, row by row as given


def pack(pieces: list, capacity: int, start: int = 0) -> Packed:
    """pieces: 1-D token tensors, packed by first_fit into rows of at most capacity (or the longest
    piece); positions count from `start` in each piece."""
    bins = first_fit([len(p) for p in pieces], max(capacity, max(len(p) for p in pieces)))
    width = max(sum(len(pieces[i]) for i in members) for members in bins)
    device = pieces[0].device
    ids = torch.zeros(len(bins), width, dtype=torch.long, device=device)  # (k, width)
    positions = torch.zeros(len(bins), width, dtype=torch.long, device=device)  # (k, width)
    owner = torch.full((len(bins), width), len(pieces), device=device)  # (k, width)
    at = [None] * len(pieces)
    for b, members in enumerate(bins):
        column = 0
        for i in members:
            n = len(pieces[i])
            ids[b, column : column + n] = pieces[i]
            positions[b, column : column + n] = start + torch.arange(n, device=device)
            owner[b, column : column + n] = i
            at[i] = (b, column)
            column += n
        positions[b, column:] = start + torch.arange(width - column, device=device)  # the tail
        owner[b, column:] = len(pieces) + 1 + b  # the tail sees only itself (and a prompt)
    return Packed(ids=ids, positions=positions, owner=owner, at=at)


def packed_states(model, input_ids, attention_mask, n_completion: int, *, hidden: bool,
                  capacity: int = 0) -> torch.Tensor:
    """(B, n_completion, V) logits, or with hidden=True (B, n_completion, H) last hidden states,
    where [:, t] predicts input_ids[:, -n_completion + t]: the padded forward's values on every
    completion token the attention_mask marks, 0 past each row's end. The rows with a
    completion token run packed (above), in packed rows of `capacity` tokens (0: PACK_TOKENS, or
    the longest)."""
    from features.fast_paths import model_outputs  # here: fast_paths imports this module
    B, L = input_ids.shape
    first_completion = L - n_completion
    spans = row_spans(attention_mask, n_completion)
    # The rows with a token to predict
    nonempty = [r for r in range(B) if spans[r][1] > first_completion]
    head = getattr(model, "module", model).get_output_embeddings().weight  # (V, H)
    out = head.new_zeros(B, n_completion, head.shape[1] if hidden else head.shape[0])  # (B, T, D)
    if not nonempty:
        return out
    pieces = [input_ids[r, spans[r][0] : spans[r][1]] for r in nonempty]  # each (n_r,)
    packed = pack(pieces, capacity or PACK_TOKENS)
    at_packed, at_column, at_row, at_completion = [], [], [], []  # each predicting position
    for i, r in enumerate(nonempty):
        packed_row, column = packed.at[i]
        n = spans[r][1] - first_completion  # the row's completion tokens
        at_packed += [packed_row] * n
        at_column += range(column + first_completion - spans[r][0] - 1,
                           column + spans[r][1] - spans[r][0] - 1)
        at_row += [r] * n
        at_completion += range(n)
    device = packed.ids.device
    keep = torch.tensor(sorted(set(at_column)), device=device)  # (K,) the columns that predict
    # No cache: transformers reads the restarts as boundaries only without one
    states = model_outputs(model, hidden, keep, input_ids=packed.ids,
                           position_ids=packed.positions, use_cache=False)  # (k, K, D)
    picked = states[torch.tensor(at_packed, device=device),
                    torch.searchsorted(keep, torch.tensor(at_column, device=device))]  # (N, D)
    index = (torch.tensor(at_row, device=device), torch.tensor(at_completion, device=device))
    return out.index_put(index, picked.to(out.dtype))  # (B, T, D) out of place: grads flow


def prompt_then_own_mask(packed: Packed, plen: int) -> torch.Tensor:
    """(k, 1, width, plen + width) bool: each token sees the whole prompt (its KV cache) and the
    tokens of its own run up to itself, never another completion's."""
    owner = packed.owner  # (k, width)
    column = torch.arange(owner.shape[1], device=owner.device)  # (width,)
    own = (owner[:, :, None] == owner[:, None, :]) & (column[None, :] <= column[:, None])
    prompt = torch.ones(*owner.shape, plen, dtype=torch.bool, device=owner.device)
    return torch.cat([prompt, own], 2)[:, None]  # (k, 1, width, plen + width)


def group_states(model, input_ids, attention_mask, n_completion: int,
                 hidden: bool = False) -> torch.Tensor:
    """shared_prefix_logits' values for G rows with one prompt, padding-free: the prompt runs
    once (its KV cache), then the group's completions packed after it into rows no longer than
    its longest (prompt_then_own_mask). (G, t, V or H), t the group's longest completion; 0 past
    each row's end."""
    from features.fast_paths import (_check_cache, checkpointing, layer_flags,  # here: a cycle
                                     model_outputs, prompt_cache)
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if str(inner.config._attn_implementation).startswith("flash"):
        raise ValueError("flash-attention takes no 4-D mask, which the shared prompt's packed "
                         "completions need: SHARED_PREFIX=0 with PADDING_FREE on this model")
    G, L = input_ids.shape
    first_completion = L - n_completion
    spans = row_spans(attention_mask, n_completion)
    completion_lens = [end - first_completion for _, end in spans]  # each row's completion tokens
    prompt = input_ids[:1, spans[0][0] : first_completion]  # (1, plen) the group's one prompt
    plen = prompt.shape[1]
    fed = [r for r in range(G) if completion_lens[r] > 1]  # rows whose tokens predict a next one
    repeats = 1  # the prompt's cache, once per packed row of completions
    packed = None
    if fed:  # each fed completion but its last token, which predicts nothing
        pieces = [input_ids[r, first_completion : first_completion + completion_lens[r] - 1]
                  for r in fed]
        packed = pack(pieces, PACK_TOKENS, start=plen)
        repeats = packed.ids.shape[0]
    cache, first = prompt_cache(model, prompt, torch.ones_like(prompt), repeats,
                                hidden)  # first: (k, 1, D)
    device = first.device
    out = first.new_zeros(G, max(max(completion_lens), 1), first.shape[-1])  # (G, t, D)
    nonempty = [r for r in range(G) if completion_lens[r]]  # rows with a token to predict
    out = out.index_put((torch.tensor(nonempty, dtype=torch.long, device=device),
                         torch.zeros(len(nonempty), dtype=torch.long, device=device)),
                        first[0].expand(len(nonempty), -1))  # token 0: the prompt's last position
    if packed is None:
        return out
    switch = contextlib.nullcontext()  # no layer recomputes: its flags need no switching
    if checkpointing(inner):
        switch = layer_flags(inner, _can_checkpoint_with_cache=True)
    with switch:
        rest = model_outputs(model, hidden, 0, input_ids=packed.ids, past_key_values=cache,
                             position_ids=packed.positions,
                             attention_mask=prompt_then_own_mask(packed, plen))  # (k, width, D)
    _check_cache(cache, plen + packed.ids.shape[1], inner)
    cache.crop(plen)  # back to the prompt: checkpointed layers recompute on it in backward
    at_packed, at_column, at_row, at_completion = [], [], [], []  # each fed token's prediction
    for i, r in enumerate(fed):
        packed_row, column = packed.at[i]
        n = completion_lens[r] - 1
        at_packed += [packed_row] * n
        at_column += range(column, column + n)
        at_row += [r] * n
        at_completion += range(1, n + 1)
    picked = rest[torch.tensor(at_packed, device=device),
                  torch.tensor(at_column, device=device)]  # (N, D)
    index = (torch.tensor(at_row, device=device), torch.tensor(at_completion, device=device))
    return out.index_put(index, picked)  # (G, t, D)
