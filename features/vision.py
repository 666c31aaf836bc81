"""Images in GRPO: a vision-language model (transformers' image-text-to-text: Idefics3, SmolVLM,
Qwen2-VL, Qwen2.5-VL) as the policy and on the reference server, the images of a data row, and the
checks an image passes before any decoder sees it (docs/vision.md).

Images enter where the prompt is built: the processor turns each <image> mark of a question into
the model's image tokens and each image into pixels. The pixels (the processor's tensors, one row
per completion) ride in the trainer's Rollout and Batch into every forward; the images travel to
ref_server.py as their own PNG or JPEG bytes, which the server decodes with its own processor: no
pickled or model-shaped tensor crosses the wire, and both sides see the same pixels.

    python scripts/make_vision_model.py        # the SmolVLM-shaped model this is tested on
"""
import io
import json
import math
import os
import struct
import sys
import zlib

import torch

from features import env_overrides

FREEZE_VISION = False  # True = the vision tower stays as it is (EasyR1's freeze_vision_tower)
# One pixel budget (EasyR1's min_pixels / max_pixels), applied once as the data loads (fit_pixels):
# the trainer, the server and vLLM then see the same image and the same number of image tokens.
MIN_PIXELS = 0  # width x height at least; smaller images are scaled up (EasyR1: 262,144); 0 = none
MAX_PIXELS = 2**22  # width x height at most; larger scaled down; the server refuses more (header)
MAX_QUESTION_PIXELS = 2**23  # all of one question's images together: what one upload may decode
MAX_IMAGES = 8  # images per question (geometry3k has one)
MAX_IMAGE_BYTES = 16 * 2**20  # encoded bytes of one question's images together
MAX_ASPECT_RATIO = 200  # an image's long side over its short one at most (Qwen's processors: 200)
env_overrides.apply_env_overrides(globals(), "features/vision.py")


IMAGE_MARK = "<image>"  # where a question's image stands in its text (geometry3k's problems)
IMAGE_FORMATS = ("PNG", "JPEG")  # what an image may be; anything else is refused undecoded
TESTED_TYPES = ("idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")  # run and tested (docs/vision.md)
QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")  # all images' patches in one flat tensor, 3-D positions
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in Qwen's text
VIDEO_TYPES = ("qwen2_vl", "qwen2_5_vl", "smolvlm")  # processors that need a video processor
PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "smolvlm": "SmolVLMProcessor"}  # theirs, where a folder does not name it
WIRE_FIELDS = ("image_bytes", "image_ends")  # a group's images in an upload (pack_images)


def model_type(path: str) -> str | None:
    """The model_type in a folder's (or hub id's) config when it is a vision-language model (it
    has a vision_config), else None: no weights are read, so settings can be checked first."""
    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f)
    else:  # a hub id: its config alone is fetched
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).to_dict()
    return config.get("model_type") if "vision_config" in config else None


def check_settings(path: str, *, tools_on: bool, use_triton: bool, use_vllm: bool) -> bool:
    """Whether MODEL_PATH (path) is a vision-language model. For one, stop on settings that cannot
    work with images (the keywords: TOOLS set, USE_TRITON, USE_VLLM); the trainer then switches off
    the fast paths that run the text model alone (features/fast_paths.py)."""
    if not 0 <= MIN_PIXELS <= MAX_PIXELS or MAX_PIXELS < 1:
        sys.exit(f"MIN_PIXELS = {MIN_PIXELS}, MAX_PIXELS = {MAX_PIXELS}: need "
                 "0 <= MIN_PIXELS <= MAX_PIXELS and MAX_PIXELS >= 1")
    kind = model_type(path)
    if kind is None and FREEZE_VISION:
        sys.exit("FREEZE_VISION with a text model: MODEL_PATH has no vision tower to freeze")
    if kind is None:
        return False
    if kind not in TESTED_TYPES:
        sys.exit(f"MODEL_PATH is a {kind!r} vision-language model; this toolkit runs "
                 f"{TESTED_TYPES} (docs/vision.md says why)")
    refused = {"TOOLS": (tools_on, "a tool's result turn has no image"),
               "USE_TRITON": (use_triton, "the fused loss reads hidden states, not pixels")}
    if kind in VIDEO_TYPES and not has_torchvision():  # vLLM's modules for them import it
        reason = f"vLLM's {kind} needs torchvision, which is not installed (docs/vision.md)"
        refused["USE_VLLM"] = (use_vllm, reason)
    for name, (on, reason) in refused.items():
        if on:
            sys.exit(f"{name} with a vision-language model: {reason}; set it off "
                     "(docs/vision.md)")
    if use_vllm and kind in VIDEO_TYPES:
        print(f"USE_VLLM with {kind}: checked here up to vLLM's expansion of image marks; "
              "bench/gpu_checks.sh part5 runs it whole on a GPU", flush=True)
    return True


def has_torchvision() -> bool:
    """Whether torchvision is installed: vLLM's Qwen2-VL and SmolVLM modules import it, and the
    CPU machines here have none (its CPU wheel does not match torch 2.13's)."""
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


class ImageTextProcessor:
    """A vision-language model's processor where the trainer expects a tokenizer: called with
    images it is the processor (image tokens in the text, pixels beside it), without them the
    tokenizer; every other attribute (pad_token_id, batch_decode...) is the tokenizer's. Saving
    saves the processor, so a checkpoint loads as the model it is."""

    def __init__(self, processor, mark=IMAGE_MARK):
        self.processor = processor
        self.image_processor = processor.image_processor
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        self.mark = mark  # what stands for one image in this model's text (Qwen's: QWEN_MARK)

    def __getattr__(self, name):  # called only for names this class does not hold itself
        return getattr(self.processor.tokenizer, name)

    def chat_template(self) -> str | None:
        """The processor's chat template (a released VLM folder's chat_template file), else its
        tokenizer's."""
        own = getattr(self.processor, "chat_template", None)
        return own or self.processor.tokenizer.chat_template

    def takes_parts(self) -> bool:
        """Whether the chat template reads a message's content as a list of parts
        ({"type": "text"}, {"type": "image"}), as SmolVLM's and Qwen2-VL's do: handed a plain
        string, SmolVLM's renders "User: <end_of_utterance>", the question lost."""
        probe = [{"role": "user", "content": [{"type": "text", "text": "PROBE"}]}]
        try:
            shown = self.processor.tokenizer.apply_chat_template(
                probe, chat_template=self.chat_template(), tokenize=False)
        except Exception:  # a template that cannot read parts at all
            return False
        return "PROBE" in shown and "'type'" not in shown  # not the list's repr

    def apply_chat_template(self, messages, **kwargs):
        """The tokenizer's apply_chat_template with this model's template, each message's text
        turned into parts (an image part where IMAGE_MARK stands) when the template reads parts."""
        if self.takes_parts():
            messages = [{**message, "content": content_parts(message["content"])}
                        for message in messages]
        return self.processor.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template(), **kwargs)

    def __len__(self):
        return len(self.processor.tokenizer)

    def __call__(self, text, images=None, **kwargs):
        if images is None:
            return self.processor.tokenizer(text, **kwargs)
        if isinstance(text, str):
            text = [text]
        text = [line.replace(IMAGE_MARK, self.mark) for line in text]
        out = rows_first(self.processor(text=text, images=images, **kwargs),
                         [len(row) for row in images])
        # vLLM expands each image mark itself: it takes the images and the ids before expansion.
        out["images"] = images
        out["marked_ids"] = self.processor.tokenizer(
            text, add_special_tokens=kwargs.get("add_special_tokens", True))["input_ids"]
        return out

    def save_pretrained(self, folder):
        return self.processor.save_pretrained(folder)


def content_parts(text: str) -> list:
    """A message's text as chat-template parts: text, and an image part where each IMAGE_MARK
    stands, in order."""
    parts = []
    for i, piece in enumerate(text.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def load(path: str, device, dtype=torch.float32):
    """(model, ImageTextProcessor) of an image-text-to-text folder or hub id."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device)
    if model_type(path) in QWEN_TYPES:  # every forward and generate: rows to Qwen's layout
        model.model.register_forward_pre_hook(qwen_forward_hook, with_kwargs=True)
        model.generate = qwen_generate(model)
    return model, load_processor(path)


def load_processor(path: str) -> ImageTextProcessor:
    """The ImageTextProcessor of an image-text-to-text folder or hub id. Qwen2-VL's and SmolVLM's
    processors need their video processor, which needs torchvision: without it, an images-only
    one is made of the folder's image processor, tokenizer and processor settings."""
    from transformers import AutoProcessor

    mark = QWEN_MARK if model_type(path) in QWEN_TYPES else IMAGE_MARK
    try:
        return ImageTextProcessor(AutoProcessor.from_pretrained(path), mark=mark)
    except (ImportError, AttributeError, OSError, ValueError):
        if model_type(path) not in VIDEO_TYPES:
            raise
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.utils import cached_file

    settings = {"processor_class": PROCESSOR_CLASSES[model_type(path)]}
    saved = cached_file(path, "processor_config.json", _raise_exceptions_for_missing_entries=False)
    if saved:  # the processor's class and its own settings (image_seq_len...)
        with open(saved) as f:
            settings.update(json.load(f))
    processor_class = getattr(transformers, settings.pop("processor_class"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = images_only(processor_class)(
        image_processor=AutoImageProcessor.from_pretrained(path, backend="pil"),
        tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template,
        **settings)
    return ImageTextProcessor(processor, mark=mark)


def images_only(processor_class):
    """processor_class (Qwen2VLProcessor, SmolVLMProcessor...) taking video_processor=None:
    images and text only, no torchvision. Saving writes the image processor, the tokenizer and
    processor_config.json, which load_processor reads back."""

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, folder, **kwargs):
            self.image_processor.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            settings = {"processor_class": processor_class.__name__}
            if hasattr(self, "image_seq_len"):  # SmolVLM's image tokens per image
                settings["image_seq_len"] = self.image_seq_len
            with open(os.path.join(folder, "processor_config.json"), "w") as f:
                json.dump(settings, f, indent=2)

    return ImagesOnly


def rows_first(inputs, images_per_row: list):
    """A processor's output with Qwen2-VL's pixels one row per prompt: it returns every image's
    patches as one flat (patches, dim) tensor and a (images, 3) grid, which no row can be taken
    from; here pixel_values (B, P, dim) and image_grid_thw (B, n, 3), zero-padded (a zero grid
    is no image), and mm_token_type_ids dropped (qwen_native derives it from the ids of each
    call). Any other model's output is returned as it is."""
    if "image_grid_thw" not in inputs:
        return inputs
    grids = inputs["image_grid_thw"].split(images_per_row)  # per row: (n_b, 3)
    patches = inputs["pixel_values"].split(inputs["image_grid_thw"].prod(-1).tolist())
    starts = [0] + torch.tensor(images_per_row).cumsum(0).tolist()
    none = inputs["pixel_values"][:0]  # (0, dim): a row without images
    rows = [torch.cat([none, *patches[a:b]]) for a, b in zip(starts, starts[1:])]  # (P_b, dim)
    inputs["pixel_values"] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (B, P, dim)
    inputs["image_grid_thw"] = torch.nn.utils.rnn.pad_sequence(grids, batch_first=True)  # (B, n, 3)
    inputs.pop("mm_token_type_ids", None)
    return inputs


def qwen_native(inputs: dict, image_token_id: int) -> bool:
    """rows_first's pixels in a call's keyword arguments back to Qwen2-VL's flat layout, with
    mm_token_type_ids from the ids (1 on an image token), in place. Whether there were any."""
    grid = inputs.get("image_grid_thw")
    if grid is None or grid.dim() != 3:
        return False
    inputs["image_grid_thw"] = grid[grid.prod(-1) > 0]  # (images, 3)
    if inputs.get("pixel_values") is not None:
        per_row = grid.prod(-1).sum(-1).tolist()  # patches of each row
        inputs["pixel_values"] = torch.cat([row[:n] for row, n in
                                            zip(inputs["pixel_values"], per_row)])  # (P, dim)
    if inputs.get("input_ids") is not None and inputs.get("mm_token_type_ids") is None:
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image_token_id).int()  # (B, L)
    return True


def qwen_forward_hook(inner, args, kwargs):
    """A forward pre-hook on Qwen2-VL's inner model (every forward, under peft and DeepSpeed
    too): qwen_native, and no position ids when the call starts a sequence, so that the model
    computes its 3-D ones from the image grid (fast_paths' are 1-D)."""
    if not qwen_native(kwargs, inner.config.image_token_id):
        return None
    past = kwargs.get("past_key_values")
    if past is None or past.get_seq_length() == 0:
        kwargs["position_ids"] = None
    return args, kwargs


def qwen_generate(model):
    """Qwen2-VL's generate, taking rows_first's pixels: generate computes the 3-D positions and
    the image features itself, from its own arguments, before any forward."""
    generate = model.generate

    def generate_rows_first(*args, **kwargs):
        qwen_native(kwargs, model.config.image_token_id)
        return generate(*args, **kwargs)
    return generate_rows_first


def load_any(path: str, device, dtype=torch.float32, attn_implementation=None):
    """(model, tokenizer, processor): a vision-language model with its ImageTextProcessor as both,
    or a causal LM, its tokenizer and None (ref_server.py's reference or teacher).
    attn_implementation: the causal LM's (features/packing.attention_implementation); None = the
    default."""
    if model_type(path):
        model, processor = load(path, device, dtype)
        return model, processor, processor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.to(device), AutoTokenizer.from_pretrained(path), None


def server_pixels(processor, images: list, rows: int, device) -> dict:
    """The reference forward's pixel inputs: an uploaded group's images (decoded and checked at
    upload, check_group) for each of its rows."""
    return to_device(vision_inputs(processor.image_processor, [images] * rows), device)


def pixels_of(tensors: dict) -> int:
    """The pixels an upload's images hold by their headers (unpack_images has checked them):
    what decoding them costs. 0 for a text upload."""
    images = unpack_images(tensors) if any(name in tensors for name in WIRE_FIELDS) else []
    return sum(width * height for width, height in
               (unopened(data, f"image {i}").size for i, data in enumerate(images)))


def image_processor_of(tokenizer):
    """The image processor behind the trainer's tokenizer, or None for a text model."""
    return tokenizer.image_processor if isinstance(tokenizer, ImageTextProcessor) else None


TOWER_NAMES = ("vision_model", "visual")  # Idefics3 / SmolVLM's vision encoder, Qwen2-VL's


def vision_tower(model):
    """The vision encoder of a vision-language model (wrapped by peft or not), or None for a
    text model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = [getattr(inner.model, name) for name in TOWER_NAMES if hasattr(inner.model, name)]
    return found[0] if found else None


def image_features(model, pixels: dict):
    """The tower and connector's output for one call's pixel inputs (this toolkit's rows-first
    layout), as the model's forward computes it: what memory_plan traces."""
    inputs = dict(pixels)
    if qwen_native(inputs, image_token_id=-1):  # Qwen2-VL: back to its flat layout
        inputs.pop("mm_token_type_ids", None)
        return model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return model.model.get_image_features(**inputs)


def freeze_tower(model) -> int:
    """EasyR1's freeze_vision_tower: the vision encoder's weights stop training (the connector
    and the language model go on). Returns how many parameters it froze."""
    tower = vision_tower(model)
    for p in tower.parameters():
        p.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


# ----------------------------------------------------------------------------- images, checked
def unopened(data: bytes, what: str = "image", max_pixels=None):
    """A PIL image of PNG or JPEG bytes with only its header read (no pixel decoded yet).
    ValueError for anything else, for more than MAX_PIXELS pixels (a decompression bomb is refused
    from its header), for sides further apart than MAX_ASPECT_RATIO (Qwen's processors raise on
    them mid-run) and for an animation (only its first frame would train). max_pixels: the bound
    (None: MAX_PIXELS; 0: none, for the run's own data, which fit_pixels scales down next)."""
    if max_pixels is None:
        max_pixels = MAX_PIXELS
    from PIL import Image

    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ValueError(f"{what}: no image bytes")
    try:
        image = Image.open(io.BytesIO(bytes(data)))
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"format {image.format}, not one of {IMAGE_FORMATS}")
        width, height = image.size
        if max_pixels and width * height > max_pixels or min(width, height) < 1:
            raise ValueError(f"{width} x {height} pixels; at most {max_pixels} in all")
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise ValueError(f"{width} x {height} pixels: sides more than {MAX_ASPECT_RATIO} "
                             "times apart")
        if getattr(image, "n_frames", 1) > 1:
            raise ValueError(f"an animation of {image.n_frames} frames; an image is one picture")
        return image
    except Exception as e:  # PIL raises many kinds on a broken file: one clear error
        raise ValueError(f"{what} is not a usable PNG or JPEG: {str(e)[:200]}") from None


def fit_pixels(data: bytes) -> bytes:
    """An image's bytes scaled, its aspect kept, to MIN_PIXELS..MAX_PIXELS pixels as PNG (EasyR1's
    process_image); bytes already within the budget come back unchanged. Sides round down when
    shrinking and up when growing, so the budget holds; a side is at least 1 pixel (a 1-pixel-high
    strip loses its aspect rather than the budget)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        pixels = width * height
        if MIN_PIXELS <= pixels <= MAX_PIXELS:
            return data
        if pixels > MAX_PIXELS:
            scale = math.sqrt(MAX_PIXELS / pixels)
            size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
            if size[0] * size[1] > MAX_PIXELS and size[1] == 1:  # held at 1: the other gives
                size = (MAX_PIXELS, 1)
            elif size[0] * size[1] > MAX_PIXELS:
                size = (1, MAX_PIXELS)
        else:
            scale = math.sqrt(MIN_PIXELS / pixels)
            size = (math.ceil(width * scale), math.ceil(height * scale))
            if size[0] * size[1] > MAX_PIXELS:  # a budget too narrow for the rounding up
                size = (math.floor(width * scale), math.floor(height * scale))
        resized = image.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    resized.save(out, format="PNG")
    return out.getvalue()


def fit_questions(questions: list) -> list:
    """The questions with each image checked where it enters (open_image: its header, its sides,
    its frames, its rows; a refusal names the row) and fitted to the pixel budget (fit_pixels):
    the trainer's data layer runs it once, before any prompt is built or group uploaded."""
    for row, question in enumerate(questions):
        for i, data in enumerate(question.get("images") or []):
            open_image(data, f"row {row} ({question['question'][:60]!r}), image {i}", 0)
    return [{**q, "images": [fit_pixels(data) for data in q["images"]]} if q.get("images") else q
            for q in questions]


def open_image(data: bytes, what: str = "image", max_pixels=None):
    """An RGB PIL image of PNG or JPEG bytes, checked from its header first (unopened, with
    max_pixels); a PNG whose data holds fewer rows than its header promises is refused (PIL fills
    them black)."""
    image = unopened(data, what, max_pixels)
    try:
        image.load()
        if image.format == "PNG":
            check_png_rows(bytes(data))
        return image.convert("RGB")
    except Exception as e:  # a header that promised more than the file holds
        raise ValueError(f"{what} is not a usable PNG or JPEG: {str(e)[:200]}") from None


PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2))  # interlaced passes: (first column, first row, column step, row step)


def check_png_rows(data: bytes) -> None:
    """ValueError unless a PNG's image data, inflated, holds every row its header promises (a
    header claiming 2048 x 2048 over 64 rows of data decodes as a mostly black picture, with no
    error from PIL). Inflates at most the promised size plus one byte."""
    chunks = []  # (type, data) in order
    at = 8  # past the signature
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        chunks.append((data[at + 4 : at + 8], data[at + 8 : at + 8 + length]))
        at += 12 + length
    header = next(body for kind, body in chunks if kind == b"IHDR")
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    interlaced = header[12] == 1
    bits = depth * PNG_CHANNELS[colour]  # per pixel
    def row_bytes(columns):  # a row's bytes with its filter byte; an empty pass has none
        return 1 + math.ceil(columns * bits / 8) if columns else 0
    passes = ADAM7 if interlaced else ((0, 0, 1, 1),)
    expected = 0
    for first_column, first_row, column_step, row_step in passes:
        columns = max(0, math.ceil((width - first_column) / column_step))
        rows = max(0, math.ceil((height - first_row) / row_step))
        expected += rows * row_bytes(columns) if columns else 0
    stream = b"".join(body for kind, body in chunks if kind == b"IDAT")
    inflated = zlib.decompressobj().decompress(stream, expected + 1)
    if len(inflated) < expected:
        raise ValueError(f"its data holds {len(inflated)} of the {expected} bytes its {width} x "
                         f"{height} header promises: rows are missing")


def check_pixel_budget(images: list) -> None:
    """ValueError when one question's images, by their headers, hold more than
    MAX_QUESTION_PIXELS pixels together: the most one upload can make a server decode, so a few
    kilobytes of large flat PNGs cannot hold its threads for seconds. Nothing is decoded here."""
    sizes = [unopened(data, f"image {i}").size for i, data in enumerate(images)]
    total = sum(width * height for width, height in sizes)
    if total > MAX_QUESTION_PIXELS:
        raise ValueError(f"{len(images)} images of {total} pixels together; at most "
                         f"{MAX_QUESTION_PIXELS} per question")


def pack_images(images: list) -> dict:
    """One question's images (bytes each) as an upload's tensors: image_bytes (N,) uint8, the
    images' bytes one after another, and image_ends (n,) int64, where each one ends."""
    if not images:
        return {}
    ends = torch.tensor([len(data) for data in images], dtype=torch.int64).cumsum(0)  # (n,)
    flat = torch.frombuffer(bytearray(b"".join(images)), dtype=torch.uint8)  # (N,)
    return {"image_bytes": flat, "image_ends": ends}


def unpack_images(tensors: dict) -> list:
    """The bytes of each image in an upload's tensors ([] for none), all or nothing: ValueError
    on a malformed field, too many images, too many bytes, or headers past the pixel budgets.
    Nothing is decoded here."""
    present = [name for name in WIRE_FIELDS if name in tensors]
    if not present:
        return []
    if len(present) != len(WIRE_FIELDS):
        raise ValueError(f"images need both {WIRE_FIELDS}; got only {present}")
    flat, ends = tensors["image_bytes"], tensors["image_ends"]
    well_typed = flat.dtype == torch.uint8 and ends.dtype == torch.int64
    if not well_typed or flat.dim() != 1 or ends.dim() != 1:
        raise ValueError(f"image_bytes must be (N,) uint8 and image_ends (n,) int64; got "
                         f"{flat.dtype} {tuple(flat.shape)}, {ends.dtype} {tuple(ends.shape)}")
    if not 1 <= len(ends) <= MAX_IMAGES:
        raise ValueError(f"{len(ends)} images for one question; 1 to {MAX_IMAGES}")
    if len(flat) > MAX_IMAGE_BYTES:
        raise ValueError(f"{len(flat)} bytes of images; at most {MAX_IMAGE_BYTES}")
    bounds = [0] + ends.tolist()
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or bounds[-1] != len(flat):
        raise ValueError(f"image_ends {bounds[1:][:20]} must rise strictly to the "
                         f"{len(flat)} bytes")
    data = flat.numpy().tobytes()
    images = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    check_pixel_budget(images)  # from the headers
    return images


def decoded(images: list) -> list:
    """Each image's bytes decoded (open_image), numbered in any error."""
    return [open_image(data, f"image {i}") for i, data in enumerate(images)]


def vision_inputs(image_processor, rows: list) -> dict:
    """A batch's pixel inputs: rows holds each row's PIL images; every tensor the image processor
    returns (Idefics3: pixel_values (B, n, 3, H, W), pixel_attention_mask (B, n, H, W)), one row
    each (Qwen2-VL's by rows_first)."""
    out = rows_first(image_processor(images=rows, return_tensors="pt"), [len(r) for r in rows])
    return {name: value for name, value in out.items() if torch.is_tensor(value)}


def image_token_count(processor, images: list) -> int:
    """How many image tokens the processor writes for these images: what a prompt showing them
    holds."""
    text = [IMAGE_MARK * len(images)]
    ids = processor(text=text, images=[images], return_tensors="pt")["input_ids"]  # (1, n)
    return int((ids == processor.image_token_id).sum())


def check_group(processor, tensors: dict, plen: int) -> list:
    """The decoded images of an uploaded group, checked against it: each row's prompt holds
    exactly the image tokens they make and no completion holds one (the forward would fail, or
    read pixels where the completion has text). ValueError otherwise. processor: an
    ImageTextProcessor, or None for a text model."""
    images = decoded(unpack_images(tensors))
    if processor is None:
        if images:
            raise ValueError("this server's model is a text model: it takes no images")
        return []
    image_tokens = tensors["input_ids"] == processor.image_token_id  # (G, L)
    expected = image_token_count(processor, images) if images else 0
    in_prompts = image_tokens[:, :plen].sum(1)  # (G,)
    if (in_prompts != expected).any() or image_tokens[:, plen:].any():
        raise ValueError(f"{len(images)} images make {expected} image tokens in every prompt and "
                         f"none in a completion; the rows hold {in_prompts.tolist()[:20]} in their "
                         f"prompts and {int(image_tokens[:, plen:].sum())} in their completions")
    return images


def group_vision_inputs(groups: list, image_processor) -> dict:
    """The pixel inputs of collated groups, one row per completion (a group's rows share its
    images; a text question's rows have none, which the processors pad and the models skip); {}
    when no group has images. ValueError when images reach a text model."""
    per_group = [decoded(unpack_images(tensors)) for tensors, _ in groups]
    if not any(per_group):
        return {}
    if image_processor is None:
        raise ValueError("images reached a text model: it has no image processor")
    rows = [images for (tensors, _), images in zip(groups, per_group)
            for _ in range(tensors["input_ids"].shape[0])]
    return vision_inputs(image_processor, rows)


def cut_at_image_tokens(completion_ids, mask, tokenizer):
    """(B, T) ids and mask where a completion that sampled the image token ends just before it: the
    token becomes padding and leaves the loss with what follows, as every forward counts image
    tokens against the pixels. Rare: the policy is never asked to write one. A text model's
    tokenizer: unchanged."""
    if not isinstance(tokenizer, ImageTextProcessor):
        return completion_ids, mask
    sampled_image = completion_ids == tokenizer.image_token_id  # (B, T)
    after = sampled_image.cumsum(1) > 0  # (B, T) from the first image token on
    return completion_ids.masked_fill(sampled_image, tokenizer.pad_token_id), mask & ~after


def vllm_prompts(encoded) -> list | None:
    """vLLM's prompts for a processor's output (ImageTextProcessor's, images in it): each prompt's
    ids with one image mark per image, which vLLM expands itself, and its images as multi-modal
    data. None for text: vLLM then takes the ids as they are."""
    if "marked_ids" not in encoded:
        return None
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images})
            for ids, images in zip(encoded["marked_ids"], encoded["images"])]


def pixel_rows(encoded, repeats: int) -> dict:
    """The pixel inputs in a processor's output for Q prompts as B = Q x repeats rows, each
    prompt's completions consecutive; {} for text (no tensor but input_ids and attention_mask)."""
    return {name: value.repeat_interleave(repeats, 0) for name, value in encoded.items()
            if name not in ("input_ids", "attention_mask") and torch.is_tensor(value)}


def select_rows(inputs: dict | None, rows) -> dict:
    """The pixel inputs of some rows (a list of indices, or a slice); {} for none."""
    return {name: value[rows] for name, value in (inputs or {}).items()}


def to_device(inputs: dict | None, device) -> dict:
    """The pixel inputs on the device; {} for none."""
    return {name: value.to(device) for name, value in (inputs or {}).items()}


def image_kwargs(questions: list) -> dict:
    """{"images": each question's decoded images} for the processor, or {} when none has any."""
    if not any(q.get("images") for q in questions):
        return {}
    return {"images": [decoded(q.get("images") or []) for q in questions]}
