"""Faster equal: the default step's faster equals of the lesson's plain definitions
(grpo_ref_split.py), each tested equal to it in values and gradients; a reader may skip this file.

The shared prefix (SHARED_PREFIX): a group's prompt runs once, its KV cache is repeated for the
group's completions, which run on it ("Prefix Grouper", arXiv 2506.05433); the prompt's cost no
longer grows with NUM_PRE_Q (tests/test_shared_prefix.py).
Chunked log-probs (LOGP_FROM_HIDDEN, LOGP_CHUNK): the definition is the trainer's per_token_logps
(log_softmax, then gather), its one home; completion_logps, which the trainer and ref_server.py run,
is tested equal to it and by default never holds whole (B, T, V) logits: the LM
head runs `chunk` tokens at a time inside one autograd function, as Liger-Kernel's fused linear
losses and Cut Cross-Entropy (arXiv 2411.09009) do (tests/test_grpo_math.py).

    COMPARE=shared_prefix python bench/bench_step_anatomy.py   # the step with it and without
    python bench/bench_logprob_memory.py          # the memory each log-prob path takes
"""
import contextlib
import functools
import threading

import torch

from features import env_overrides, packing
from features.vision import select_rows

SHARED_PREFIX = True  # each group's prompt runs once, its KV cache shared; False = full rows
LOGP_FROM_HIDDEN = True  # log-probs from the LM head's input in chunks; False = the plain logits
LOGP_CHUNK = 128  # tokens whose logits exist at once: (LOGP_CHUNK, V), not (B, T, V); 0 = all
USE_TRITON = False  # True = the fused Triton loss (grpo_loss_triton.py, GPU)
SKIP_PI_OLD = True  # MU = 1: a rank's own groups need no pi_old forward (ratio 1); False = one
env_overrides.apply_env_overrides(globals(), "features/fast_paths.py")


def switch_off_for_images():
    """A vision-language model: SHARED_PREFIX and LOGP_FROM_HIDDEN off, saying so (they run the
    text model alone, without the pixels)."""
    global SHARED_PREFIX, LOGP_FROM_HIDDEN
    text_only = [name for name, on in (("SHARED_PREFIX", SHARED_PREFIX),
                                       ("LOGP_FROM_HIDDEN", LOGP_FROM_HIDDEN)) if on]
    if text_only:
        print(f"vision model: {' and '.join(text_only)} off (they run the text model alone)",
              flush=True)
    SHARED_PREFIX = False
    LOGP_FROM_HIDDEN = False


def any_on() -> bool:
    """Whether a log-prob fast path is on; all off, the trainer runs the lesson's definition."""
    return bool(SHARED_PREFIX or LOGP_FROM_HIDDEN or LOGP_CHUNK or packing.PADDING_FREE)


# What transformers' GradientCheckpointingLayer reads on each layer: this module switches them per
# block.
LAYER_FLAGS = ("gradient_checkpointing", "_can_checkpoint_with_cache")
_FLAGS_LOCK = threading.RLock()  # one block at a time: two threads on one model undo each other


def model_outputs(model, hidden: bool, keep, **inputs) -> torch.Tensor:
    """The model's logits (B, k, V), or with hidden=True its last hidden states (B, k, H), at
    positions `keep`: an index tensor, or an int k for the last k positions (0 = all of them)."""
    if not hidden:
        return model(**inputs, logits_to_keep=keep).logits
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    states = inner.get_decoder()(**inputs).last_hidden_state  # (B, L, H) after the final norm
    if torch.is_tensor(keep):
        return states[:, keep]  # (B, k, H)
    return states[:, states.shape[1] - keep :] if keep else states  # (B, k, H)


def same_prompt_runs(prompt_ids, prompt_mask) -> list:
    """Slices of consecutive rows whose (left-padded) prompts are identical: a group's rows, at
    least."""
    same_ids = (prompt_ids[1:] == prompt_ids[:-1]).all(-1)  # (B-1,)
    same = same_ids & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (B-1,)
    starts = [0] + (torch.nonzero(~same).flatten() + 1).tolist() + [prompt_ids.shape[0]]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def shared_prefix_logits(model, input_ids, attention_mask, n_completion: int,
                         hidden: bool = False) -> torch.Tensor:
    """Logits (or hidden states) of the completion tokens for G rows with one prompt: (G, t, V) for
    the group's own t <= n_completion columns (in a batch padded to its longest completion, the
    columns after this group's longest are padding, and cost nothing here).

    Gradients flow back through the repeated cache into the prompt's forward. The prompt's last
    position predicts the first completion token; the last completion token is never an input.
    """
    G = input_ids.shape[0]
    # (G, n_completion) each
    ids, attn = input_ids[:, -n_completion:], attention_mask[:, -n_completion:]
    used = attn.any(0).nonzero()  # (k, 1) the columns any row of the group uses
    T = int(used.max()) + 1 if len(used) else 1
    # (1, plen) unpadded
    prompt = input_ids[:1, :-n_completion][attention_mask[:1, :-n_completion].bool()][None]
    plen = prompt.shape[1]
    # first (1, 1, V)
    cache, first = prompt_cache(model, prompt, torch.ones_like(prompt), G, hidden)
    if T == 1:
        return first.expand(G, 1, -1)  # (G, 1, V)
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    positions = torch.arange(plen, plen + T - 1, device=ids.device).expand(G, -1)  # (G, T - 1)
    switch = contextlib.nullcontext()  # no layer recomputes: its flags need no switching
    if checkpointing(inner):
        switch = layer_flags(inner, _can_checkpoint_with_cache=True)
    with switch:
        rest_mask = torch.cat([attn.new_ones(G, plen), attn[:, : T - 1]], 1)  # (G, plen + T - 1)
        rest = model_outputs(model, hidden, 0, input_ids=ids[:, : T - 1], past_key_values=cache,
                             position_ids=positions, attention_mask=rest_mask)  # (G, T-1, V)
    _check_cache(cache, plen + T - 1, inner)
    cache.crop(1 - T)  # back to the prompt: checkpointed layers recompute on it in backward
    return torch.cat([first.expand(G, 1, -1), rest], 1)  # (G, T, V)


def prompt_cache(model, prompt_ids, prompt_mask, repeats: int, hidden: bool = False):
    """(cache, last): each prompt's KV cache computed once and repeated `repeats` times (rows
    prompt 0 x repeats, prompt 1 x repeats, ...), and (Q, 1, V) logits of each prompt's last
    position. Prompts may be left-padded: positions count from each row's first real token."""
    # here, not at the top: it imports Triton (see grpo_loss_triton.py)
    from transformers import DynamicCache

    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    cache = DynamicCache(config=inner.config)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (Q, P)
    # Gradient checkpointing drops a KV cache in training mode (its recompute would write it twice):
    # the prompts, one row each, run uncheckpointed; the completions read the cache and keep
    # checkpointing.
    switch = contextlib.nullcontext()  # no layer recomputes: its flags need no switching
    if checkpointing(inner):
        switch = layer_flags(inner, gradient_checkpointing=False)
    with switch:
        last = model_outputs(model, hidden, 1, input_ids=prompt_ids, attention_mask=prompt_mask,
                             position_ids=positions, past_key_values=cache)  # (Q, 1, V or H)
    _check_cache(cache, prompt_ids.shape[1], inner)
    # (Q * repeats, heads, P, d) per layer; backward sums the copies
    cache.batch_repeat_interleave(repeats)
    return cache, last


def _check_cache(cache, length, model):
    # a model (or its checkpointing) that neither fills nor reads the cache
    if cache.get_seq_length() != length:
        raise RuntimeError(f"{type(model).__name__} ignored the prompt's KV cache: "
                           "set SHARED_PREFIX = False")


@functools.cache
def _flags_read() -> tuple:
    """The LAYER_FLAGS that this transformers' GradientCheckpointingLayer.__call__ reads (once per
    process)."""
    import inspect

    from transformers.modeling_layers import GradientCheckpointingLayer

    source = inspect.getsource(GradientCheckpointingLayer.__call__)
    return tuple(name for name in LAYER_FLAGS if f"self.{name}" in source)


def checkpointing(model) -> bool:
    """Whether any layer of the model recomputes in backward (GRADIENT_CHECKPOINTING): only then
    do the LAYER_FLAGS matter, and layer_flags switches them."""
    return any(getattr(layer, "gradient_checkpointing", False) for layer in model.modules())


@contextlib.contextmanager
def layer_flags(model, **flags):
    """Set LAYER_FLAGS on every layer that transformers' gradient checkpointing wraps, for the
    block.

    The one place this toolkit writes into transformers' layers (their instance __dict__, restored
    after). A transformers that renamed the flags would silently checkpoint with the cache again:
    the names are checked against the library's source here, and tests/test_shared_prefix.py checks
    the behaviour.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    unknown = [name for name in flags if name not in LAYER_FLAGS or name not in _flags_read()]
    if unknown:
        raise RuntimeError("this transformers' GradientCheckpointingLayer does not read "
                           f"{unknown}: the shared prompt cannot switch its checkpointing; "
                           "set SHARED_PREFIX = False")
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


def shared_rollout(model, tokenizer, prompts, *, gen_config, llm, eos_ids, num_pre_q) -> tuple:
    """Step 2 with each group's prompt computed once (SHARED_PREFIX): (completion_ids, None, {}),
    the same samples as the lesson's sample_completions (shared_generate); tokenizer, llm and
    eos_ids are other rollouts', unread here."""
    completion_ids = shared_generate(model, prompts.ids, prompts.mask, gen_config, num_pre_q)
    return completion_ids, None, {}


def shared_generate(model, prompt_ids, prompt_mask, gen_config, repeats: int, shared: bool = True):
    """(B, T) transformers' generate on prompts already repeated `repeats` times each (rows prompt 0
    x repeats, ...): with `shared`, each prompt's KV cache is computed once and repeated, the same
    samples for less prefill."""
    cache = None  # full rows: generate computes every prompt itself
    if shared:
        cache = prompt_cache(model, prompt_ids[::repeats, :-1], prompt_mask[::repeats, :-1],
                             repeats)[0]
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, past_key_values=cache,
                         generation_config=gen_config)
    return out[:, prompt_ids.shape[1] :]  # (B, T)


# ----------------------------------------------------------------------------- chunked log-probs
# Config fields that make a model's logits something other than lm_head(last hidden state).
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                        "output_multiplier_scale")


def spans(n: int, chunk: int) -> list:
    """Slices of `chunk` positions (the last one shorter) covering 0..n; one slice for chunk = 0."""
    if chunk < 0:
        raise ValueError(f"LOGP_CHUNK = {chunk}: need tokens per chunk >= 1, or 0 = all at once")
    step = chunk or max(n, 1)  # 0: one slice of everything
    return [slice(s, s + step) for s in range(0, n, step)]


class _TokenLogps(torch.autograd.Function):
    """log softmax(logits / T)[ids] without a (B, T, V) buffer in forward or backward.

    Forward keeps only the per-token logsumexp (B, T); backward recomputes the softmax `chunk`
    tokens at a time. With inplace=True the gradient is written over the logits themselves (nothing
    reads them after the loss), so not even a (B, T, V) gradient is allocated.
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature, inplace, chunk, with_entropy):
        logps = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)  # (B, T)
        lse, entropy = torch.empty_like(logps), torch.zeros_like(logps)  # (B, T) each
        for b, s in _row_chunks(logits, chunk):
            # (c, V) a chunk of a view: nothing is copied whole
            z = logits[b, s].float() / temperature
            lse[b, s] = torch.logsumexp(z, dim=-1)  # (c,)
            logps[b, s] = z.gather(-1, ids[b, s, None]).squeeze(-1) - lse[b, s]  # (c,)
            if with_entropy:
                entropy[b, s] = chunk_entropy(z, lse[b, s])  # (c,)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        ctx.inplace = inplace
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):  # grad_logps (B, T)
        logits, ids, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad = logits if ctx.inplace else torch.empty_like(logits)  # (B, T, V) in the logits' dtype
        for b, s in _row_chunks(logits, ctx.chunk):
            g = grad_logps[b, s].float()[:, None]  # (c, 1)
            # (c, V) softmax, recomputed
            p = torch.exp(logits[b, s].float() / temp - lse[b, s, None])
            p.mul_(-g).scatter_add_(-1, ids[b, s, None], g)  # d logp / d z = onehot - softmax
            grad[b, s] = p / temp  # read before written: in place is safe chunk by chunk
        return grad, None, None, None, None, None


def chunk_entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(c,) entropy of softmax(z) for a chunk of logits z (c, V) with their logsumexp lse (c,): lse
    - sum p z. One more (c, V) exp, never (B, T, V): the metric that shows an entropy collapse, at
    no memory cost."""
    return lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # (c,)


def _row_chunks(logits, chunk):
    """(b, slice) over every sequence, `chunk` tokens at a time."""
    B, T = logits.shape[:2]
    return [(b, s) for b in range(B) for s in spans(T, chunk)]


def chunked_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, *, chunk: int,
                    inplace_backward: bool = False, with_entropy: bool = False):
    """(B, T) fp32 log-probs of `ids` under softmax(logits / temperature); logits[:, t] predicts
    ids[:, t].

    The memory-saving form of the trainer's per_token_logps (chunk = 0: a whole row at a time).
    inplace_backward=True writes d(logits) over the logits (the caller must not read them after
    backward): saves a (B, T, V) buffer, as the Triton kernel's option of the same name.
    with_entropy: (logps, (B, T) entropies), from the same chunks.
    """
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    logps, entropy = _TokenLogps.apply(logits, ids, float(temperature), inplace_backward, chunk,
                                       with_entropy)
    return (logps, entropy) if with_entropy else logps


class _HiddenLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T / T)[ids] without ever holding the (B, T, V) logits.

    Forward keeps the hidden states and a logsumexp per token; each chunk of tokens (rows and time
    flattened) gets its own LM-head matmul. Backward recomputes that chunk's logits (one more
    matmul: the LM head's FLOPs go from 3 to 4 passes) for d(hidden) and d(weight). A weight tied to
    the input embedding (SmolLM2's) is one Parameter: autograd adds this gradient to the
    embedding's.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, chunk, with_entropy):
        h, flat = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)  # (N, H), (N,)
        logps = torch.empty(flat.shape, dtype=torch.float32, device=hidden.device)  # (N,)
        lse, entropy = torch.empty_like(logps), torch.zeros_like(logps)  # (N,) each
        for s in spans(len(flat), chunk):
            z = (h[s] @ weight.T).float().div_(temperature)  # (c, V) the only logits that exist
            lse[s] = torch.logsumexp(z, dim=-1)  # (c,)
            logps[s] = z.gather(-1, flat[s, None]).squeeze(-1) - lse[s]  # (c,)
            if with_entropy:
                entropy[s] = chunk_entropy(z, lse[s])  # (c,)
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logps.view(ids.shape), entropy.view(ids.shape)  # (B, T) each

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):  # grad_logps (B, T)
        hidden, weight, ids, lse = ctx.saved_tensors
        temp = ctx.temperature
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        flat = ids.reshape(-1)  # (N,)
        grad = grad_logps.reshape(-1).float()  # (N,)
        d_hidden = torch.empty_like(h)  # (N, H)
        d_weight = None  # (V, H) when the weight trains
        if ctx.needs_input_grad[1]:  # fp32 even for a bf16 weight: hundreds of chunks add up here
            d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in spans(len(flat), ctx.chunk):
            g = grad[s, None]  # (c, 1)
            d_z = (h[s] @ weight.T).float().div_(temp).sub_(lse[s, None]).exp_()  # (c, V) softmax
            d_z = d_z.mul_(-g).scatter_add_(-1, flat[s, None], g)  # (c, V) d loss/d (logits / t)
            d_z = d_z.div_(temp).to(weight.dtype)  # (c, V) d loss/d logits
            d_hidden[s] = d_z @ weight  # (c, H)
            if d_weight is not None and d_weight.dtype == d_z.dtype:
                d_weight.addmm_(d_z.T, h[s])  # (V, H) in place: no (V, H) temporary
            elif d_weight is not None:
                d_weight += d_z.T @ h[s]  # (V, H) a bf16 temporary, summed in fp32
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden.view_as(hidden), d_weight, None, None, None, None


def lm_head_weight(model) -> torch.Tensor:
    """(V, H) the output projection when the model's logits are exactly hidden @ weight.T; else a
    clear error."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    head = inner.get_output_embeddings()
    changed = {k: getattr(inner.config, k) for k in LOGIT_POSTPROCESSING
               if getattr(inner.config, k, None) not in (None, 1, 1.0)}
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or changed:
        raise ValueError(f"{type(inner).__name__}'s logits are not a bias-free linear map of its "
                         f"last hidden state ({changed or type(head).__name__}): "
                         "set LOGP_FROM_HIDDEN = False")
    return head.weight


def hidden_logps(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                 temperature: float = 1.0, *, chunk: int, with_entropy: bool = False):
    """(B, T) fp32 log softmax(hidden @ weight.T / temperature)[ids], `chunk` tokens of logits at a
    time.

    hidden (B, T, H) is the LM head's input; weight (V, H) its weight (lm_head_weight). Equal, in
    value and in the gradients of hidden and weight, to the definition on the full logits.
    with_entropy: (logps, (B, T) entropy of each token's distribution, detached), from the same
    chunks.
    """
    if hidden.shape[:2] != ids.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match ids {tuple(ids.shape)}")
    logps, entropy = _HiddenLogps.apply(hidden, weight, ids, float(temperature), chunk,
                                        with_entropy)
    return (logps, entropy) if with_entropy else logps


def completion_logits(model, input_ids, attention_mask, n_completion: int,
                      shared_prefix: bool = False, hidden: bool = False,
                      vision_inputs=None, padding_free: bool = False) -> torch.Tensor:
    """(B, n_completion, V) logits where [:, t] predicts input_ids[:, -n_completion + t];
    hidden=True gives (B, n_completion, H) instead: the last hidden states there, the LM head's
    input.

    Rows may be left-padded (attention_mask 0): positions count from each row's first real token, so
    a padded row gets exactly the logits of the same row unpadded. shared_prefix=True runs each
    prompt once for the consecutive rows that share it (above): the same values on every
    completion token (0 on the padding past a group's longest completion). vision_inputs: a
    vision-language model's pixels, one row per row (features/vision.py), for the plain forward.
    padding_free: the same values on every token the attention_mask marks, computed packed
    (features/packing.py), 0 on the completions' padding.
    """
    if vision_inputs and (shared_prefix or hidden or padding_free):
        raise ValueError("pixels go through the whole model in rectangles: shared_prefix, hidden "
                         "and padding_free take text")
    if shared_prefix:
        B, T = input_ids.shape[0], n_completion
        group_states = shared_prefix_logits  # one group's prompt once, its completions padded
        if padding_free:
            group_states = packing.group_states  # its completions packed after the prompt
        out = None
        for r in same_prompt_runs(input_ids[:, :-T], attention_mask[:, :-T]):
            # (G, t, V) t <= T
            part = group_states(model, input_ids[r], attention_mask[r], T, hidden)
            if out is None:
                out = part.new_zeros(B, T, part.shape[-1])  # (B, T, V) 0 past each group's end
            out[r, : part.shape[1]] = part
        return out
    if padding_free:
        return packing.packed_states(model, input_ids, attention_mask, n_completion,
                                     hidden=hidden)  # (B, T, V) or (B, T, H)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
    L = input_ids.shape[1]
    # (T,) positions that predict
    keep = torch.arange(L - n_completion - 1, L - 1, device=input_ids.device)
    # The LM head runs on those positions only. Indices, not a slice of n + 1 positions: the
    # slice's backward would allocate a second (B, T + 1, V) buffer.
    pixels = vision_inputs or {}  # a vision-language model's, one row per row
    return model_outputs(model, hidden, keep, input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, **pixels)  # (B, T, V) or (B, T, H)


def logps_function(temperature: float):
    """The lesson's per_token_logps(model, ids, mask, n_completion, with_entropy, **pixels) as
    completion_logps computes it with this module's switches as they are now."""
    def logps_of(model, input_ids, attention_mask, n_completion, with_entropy=False, **pixels):
        return completion_logps(model, input_ids, attention_mask, n_completion, temperature,
                                chunk=LOGP_CHUNK, shared_prefix=SHARED_PREFIX,
                                from_hidden=LOGP_FROM_HIDDEN, with_entropy=with_entropy,
                                vision_inputs=pixels, padding_free=packing.PADDING_FREE)
    return logps_of


def completion_logps(model, input_ids, attention_mask, n_completion: int, temperature: float,
                     micro_batch: int = 0, shared_prefix: bool = False, *, chunk: int,
                     from_hidden: bool, with_entropy: bool = False, vision_inputs=None,
                     padding_free: bool = False):
    """(B, n_completion) log-probs of the last `n_completion` tokens of each row, micro_batch rows
    at a time. from_hidden: from the hidden states, `chunk` tokens of logits at a time
    (hidden_logps); else from the whole logits (chunked_logps). with_entropy: (logps, (B,
    n_completion) entropies), from the same pass. vision_inputs: each row's pixels, or None.
    padding_free: each micro-batch's rows packed (features/packing.py)."""
    step = micro_batch or input_ids.shape[0]
    out = []
    for i in range(0, input_ids.shape[0], step):
        ids, attn = input_ids[i : i + step], attention_mask[i : i + step]  # (b, L) each
        pixels = {}  # this micro-batch's pixel inputs; text: none
        if vision_inputs:
            pixels = select_rows(vision_inputs, slice(i, i + step))
        states = completion_logits(model, ids, attn, n_completion, shared_prefix,
                                   hidden=from_hidden, vision_inputs=pixels,
                                   padding_free=padding_free)  # (b, T, H or V)
        targets = ids[:, -n_completion:]  # (b, T)
        if from_hidden:
            out.append(hidden_logps(states, lm_head_weight(model), targets, temperature,
                                    chunk=chunk, with_entropy=with_entropy))  # (b, T) or two
        else:  # nothing else reads these logits, so their gradient may overwrite them
            out.append(chunked_logps(states, targets, temperature, chunk=chunk,
                                     inplace_backward=True, with_entropy=with_entropy))
    if with_entropy:
        return tuple(torch.cat(parts) for parts in zip(*out))  # (B, T), (B, T)
    return torch.cat(out)  # (B, T)
