"""A SmolVLM-shaped vision-language model made here: no VLM weights reach this machine, but
SmolVLM's language model is SmolLM2-135M, the embedded model. So: Idefics3 (SmolVLM's architecture)
with the embedded model's weights as its language model, a small vision encoder and connector drawn
at random from a seed, and a processor over the embedded tokenizer with the image tokens added. Then
LLaVA's first stage: a short supervised pass on image-caption pairs with the language model frozen,
which aligns the random vision side with it before any reward is asked for (docs/vision.md).

    python scripts/make_vision_model.py          # writes the folder the CPU demo trains
"""
import os
import random
import shutil

import torch

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")  # Idefics3's, added
VISION = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              image_size=64, patch_size=8)  # 64 patches, 16 image tokens after scale_factor 2
SCALE_FACTOR = 2  # Idefics3's pixel shuffle: patches merged per image token along each side
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32)  # the tests'; vLLM's CPU attention: >= 32


def tokens_per_image() -> int:
    """Image tokens the demo's processor writes for one image: its patches, merged by the pixel
    shuffle (SCALE_FACTOR along each side)."""
    return (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2


def build(text_path: str, folder: str, *, seed: int, tiny: bool = False,
          kind: str = "idefics3") -> str:
    """Write an Idefics3 model (kind "idefics3") or SmolVLM2's ("smolvlm": the same parts, its
    processor images-only) and its processor to `folder`: the language model is text_path's (a
    Llama causal LM: the embedded SmolLM2-135M), or with tiny=True a random one of its
    vocabulary and TINY_TEXT's size; vision encoder and connector random from `seed`. Returns
    folder."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from features.vision import images_only

    name = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[kind]
    image_processor_class = {"idefics3": Idefics3ImageProcessorPil,
                             "smolvlm": SmolVLMImageProcessorPil}[kind]

    tokenizer = AutoTokenizer.from_pretrained(text_path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    torch.manual_seed(seed)
    if tiny:
        base = AutoConfig.from_pretrained(text_path).to_dict()
        text_config = LlamaConfig(**{**base, **TINY_TEXT}).to_dict()
        text_weights = None
    else:
        text_model = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)
        text_config = text_model.config.to_dict()
        text_weights = text_model.state_dict()
    config = getattr(transformers, f"{name}Config")(
        text_config=text_config, vision_config=VISION, scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=text_config["tie_word_embeddings"])
    config.text_config.pad_token_id = tokenizer.pad_token_id
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).float()
    if text_weights is not None:  # the embedded model's own weights, every one of them
        inner = {k[len("model."):]: v for k, v in text_weights.items() if k.startswith("model.")}
        model.model.text_model.load_state_dict(inner, strict=True)
    side = VISION["image_size"]
    image_processor = image_processor_class(
        do_resize=True, size={"longest_edge": side}, do_image_splitting=False,
        max_image_size={"longest_edge": side})
    parts = dict(image_processor=image_processor, tokenizer=tokenizer,
                 image_seq_len=tokens_per_image(), chat_template=tokenizer.chat_template)
    if kind == "smolvlm":  # its processor wants a video processor (torchvision): images only
        processor = images_only(transformers.SmolVLMProcessor)(video_processor=None, **parts)
    else:
        processor = transformers.Idefics3Processor(**parts)
    # The processor adds its own tokens (<end_of_utterance>): the embeddings cover them all.
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return save_whole(model, processor, folder)


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # added
QWEN_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8,
                   spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2)  # 64 px: 16 tokens
QWEN_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32,
                 rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})  # 3-D: 16 = 32 / 2


def build_qwen(text_path: str, folder: str, *, seed: int, kind: str = "qwen2_vl") -> str:
    """Write a tiny random Qwen2-VL (kind "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") and its
    processor to `folder`, on the embedded tokenizer with Qwen's vision tokens added: the tests'
    model of the flat pixel layout and 3-D positions. Returns folder."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from features.vision import images_only

    tokenizer = AutoTokenizer.from_pretrained(text_path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start", "vision_end", "image", "video"), QWEN_TOKENS)}
    text_config = dict(QWEN_TEXT, vocab_size=len(tokenizer), tie_word_embeddings=True,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    vision_config = dict(QWEN_VISION)
    if kind == "qwen2_5_vl":  # its tower: windowed attention, a gated MLP, out_hidden_size
        vision_config = dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2,
                             intermediate_size=64, patch_size=8, spatial_merge_size=2,
                             temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])
    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}
    config_class = getattr(transformers, f"{names[kind]}Config")
    model_class = getattr(transformers, f"{names[kind]}ForConditionalGeneration")
    torch.manual_seed(seed)
    config = config_class(text_config=text_config, vision_config=vision_config, **ids)
    model = model_class(config).float()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    side = VISION["image_size"]
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=side * side // 4, max_pixels=side * side, patch_size=8, merge_size=2,
        temporal_patch_size=2)
    processor = images_only(transformers.Qwen2VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
        chat_template=tokenizer.chat_template)
    return save_whole(model, processor, folder)


def save_whole(model, processor, folder: str) -> str:
    """Write model and processor to `folder` through a temporary folder renamed at the end:
    readers see no folder or a whole one. Returns folder."""
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def caption_batch(processor, rows, *, system_prompt, prefill):
    """(inputs, labels) for the caption pass: each row's chat prompt (system, the question with
    its image, the assistant turn opened with `prefill`) and its gold caption closed as the
    trainer's completions are, the loss on the caption's tokens only."""
    from features.vision import decoded

    prompts = []
    targets = []
    for row in rows:
        messages = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": row["question"]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(text + prefill)
        targets.append(f"{row['gold']}</answer>{processor.eos_token}")
    images = [decoded(row["images"]) for row in rows]
    full = [p + t for p, t in zip(prompts, targets)]
    inputs = processor(text=full, images=images, return_tensors="pt", padding=True,
                       padding_side="right", add_special_tokens=False)
    labels = inputs["input_ids"].clone()  # (B, L)
    for i, prompt in enumerate(prompts):
        prompt_len = len(processor(text=[prompt], images=[images[i]], add_special_tokens=False,
                                   return_tensors="pt")["input_ids"][0])
        labels[i, :prompt_len] = -100
    labels[inputs["attention_mask"] == 0] = -100
    return {name: value for name, value in inputs.items() if torch.is_tensor(value)}, labels


def align(folder: str, rows: list, *, steps: int, batch: int, lr: float, seed: int,
          system_prompt: str, prefill: str, train_language: bool = False, log=print) -> list:
    """LLaVA's first stage on `folder` in place: `steps` AdamW steps of the caption loss on
    batches of `rows`, the language model frozen (vision encoder and connector train; with
    train_language everything trains, a plain supervised pass). Returns each step's loss."""
    from tqdm import tqdm

    from features.vision import load

    model, processor = load(folder, "cpu")  # processor: an ImageTextProcessor
    if not train_language:
        model.get_decoder().requires_grad_(False)
        model.lm_head.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    losses = []
    quiet = log is not print  # a caller's own log: no bar
    for step in tqdm(range(steps), desc="caption pass", dynamic_ncols=True, disable=quiet):
        inputs, labels = caption_batch(
            processor, rng.sample(rows, batch), system_prompt=system_prompt, prefill=prefill
        )
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            log(f"caption pass step {step}: loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(folder)
    return losses
