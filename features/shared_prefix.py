"""The shared-prefix forward (SHARED_PREFIX): a group's prompt runs once, its KV cache is repeated for the
group's answers, and the completions run on it ("Prefix Grouper", arXiv 2506.05433). Same log-probs and
gradients as full rows (tests/test_shared_prefix.py); the prompt's cost no longer grows with NUM_PRE_Q.

    python bench/bench_step_anatomy.py            # COMPARE=shared_prefix: the step with it and without
"""
import contextlib
import functools
import threading

import torch

# What transformers' GradientCheckpointingLayer reads on each layer: this module switches them per block.
LAYER_FLAGS = ("gradient_checkpointing", "_can_checkpoint_with_cache")
_FLAGS_LOCK = threading.RLock()  # one block at a time: two threads on one model undo each other


def model_outputs(model, hidden: bool, keep, **inputs) -> torch.Tensor:
    """The model's logits (B, k, V), or with hidden=True its last hidden states (B, k, H), at positions
    `keep`: an index tensor, or an int k for the last k positions (0 = all of them)."""
    if not hidden:
        return model(**inputs, logits_to_keep=keep).logits
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    states = inner.get_decoder()(**inputs).last_hidden_state  # (B, L, H) after the final norm
    if torch.is_tensor(keep):
        return states[:, keep]  # (B, k, H)
    return states[:, states.shape[1] - keep :] if keep else states  # (B, k, H)


def same_prompt_runs(prompt_ids, prompt_mask) -> list:
    """Slices of consecutive rows whose (left-padded) prompts are identical: a group's rows, at least."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (B-1,)
    starts = [0] + (torch.nonzero(~same).flatten() + 1).tolist() + [prompt_ids.shape[0]]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def shared_prefix_logits(model, input_ids, attention_mask, n_completion: int, hidden: bool = False) -> torch.Tensor:
    """Logits (or hidden states) of the completion tokens for G rows with one prompt: (G, t, V) for the
    group's own t <= n_completion columns (in a batch padded to its longest answer, the columns after this
    group's longest are padding, and cost nothing here).

    Gradients flow back through the repeated cache into the prompt's forward. The prompt's last
    position predicts the first completion token; the last completion token is never an input.
    """
    G = input_ids.shape[0]
    ids, attn = input_ids[:, -n_completion:], attention_mask[:, -n_completion:]  # (G, n_completion) each
    used = attn.any(0).nonzero()  # (k, 1) the columns any row of the group uses
    T = int(used.max()) + 1 if len(used) else 1
    prompt = input_ids[:1, :-n_completion][attention_mask[:1, :-n_completion].bool()][None]  # (1, plen) unpadded
    plen = prompt.shape[1]
    cache, first = prompt_cache(model, prompt, torch.ones_like(prompt), G, hidden)  # first (1, 1, V)
    if T == 1:
        return first.expand(G, 1, -1)  # (G, 1, V)
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    positions = torch.arange(plen, plen + T - 1, device=ids.device).expand(G, -1)  # (G, T - 1)
    with layer_flags(inner, _can_checkpoint_with_cache=True):
        rest = model_outputs(model, hidden, 0, input_ids=ids[:, : T - 1], past_key_values=cache,
                             position_ids=positions,
                             attention_mask=torch.cat([attn.new_ones(G, plen), attn[:, : T - 1]], 1))  # (G, T-1, V)
    _check_cache(cache, plen + T - 1, inner)
    cache.crop(1 - T)  # back to the prompt: checkpointed layers recompute on it in backward
    return torch.cat([first.expand(G, 1, -1), rest], 1)  # (G, T, V)


def prompt_cache(model, prompt_ids, prompt_mask, repeats: int, hidden: bool = False):
    """(cache, last): each prompt's KV cache computed once and repeated `repeats` times (rows
    prompt 0 x repeats, prompt 1 x repeats, ...), and (Q, 1, V) logits of each prompt's last position.
    Prompts may be left-padded: positions count from each row's first real token."""
    from transformers import DynamicCache  # here, not at the top: it imports Triton (see grpo_loss_triton.py)

    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    cache = DynamicCache(config=inner.config)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (Q, P)
    # Gradient checkpointing drops a KV cache in training mode (its recompute would write it twice):
    # the prompts, one row each, run uncheckpointed; the completions read the cache and keep checkpointing.
    with layer_flags(inner, gradient_checkpointing=False):
        last = model_outputs(model, hidden, 1, input_ids=prompt_ids, attention_mask=prompt_mask,
                             position_ids=positions, past_key_values=cache)  # (Q, 1, V), or (Q, 1, H)
    _check_cache(cache, prompt_ids.shape[1], inner)
    cache.batch_repeat_interleave(repeats)  # (Q * repeats, heads, P, d) per layer; backward sums the copies
    return cache, last


def _check_cache(cache, length, model):
    if cache.get_seq_length() != length:  # a model (or its checkpointing) that neither fills nor reads the cache
        raise RuntimeError(f"{type(model).__name__} ignored the prompt's KV cache: set SHARED_PREFIX = False")


@functools.cache
def _flags_read() -> tuple:
    """The LAYER_FLAGS that this transformers' GradientCheckpointingLayer.__call__ reads (once per process)."""
    import inspect

    from transformers.modeling_layers import GradientCheckpointingLayer

    source = inspect.getsource(GradientCheckpointingLayer.__call__)
    return tuple(name for name in LAYER_FLAGS if f"self.{name}" in source)


@contextlib.contextmanager
def layer_flags(model, **flags):
    """Set LAYER_FLAGS on every layer that transformers' gradient checkpointing wraps, for the block.

    The one place this toolkit writes into transformers' layers (their instance __dict__, restored after).
    A transformers that renamed the flags would silently checkpoint with the cache again: the names are
    checked against the library's source here, and tests/test_shared_prefix.py checks the behaviour.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    unknown = [name for name in flags if name not in LAYER_FLAGS or name not in _flags_read()]
    if unknown:
        raise RuntimeError(f"this transformers' GradientCheckpointingLayer does not read {unknown}: the shared "
                           "prompt cannot switch its checkpointing; set SHARED_PREFIX = False")
    layers = [mod for mod in model.modules() if isinstance(mod, GradientCheckpointingLayer)]
    with _FLAGS_LOCK:  # two in-process reference servers may share one model (tests do)
        saved = [{name: layer.__dict__[name] for name in flags if name in layer.__dict__}
                 for layer in layers]
        for layer in layers:
            layer.__dict__.update(flags)
        try:
            yield
        finally:
            for layer, old in zip(layers, saved):
                for name in flags:
                    del layer.__dict__[name]
                layer.__dict__.update(old)


def generate(model, prompt_ids, prompt_mask, gen_config, repeats: int, shared: bool = True):
    """(B, T) transformers' generate on prompts already repeated `repeats` times each (rows prompt 0 x repeats, ...):
    with `shared`, each prompt's KV cache is computed once and repeated, the same samples for less prefill."""
    cache = prompt_cache(model, prompt_ids[::repeats, :-1], prompt_mask[::repeats, :-1], repeats)[0] if shared else None
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                         generation_config=gen_config)
    return out[:, prompt_ids.shape[1] :]  # (B, T)
