"""The memory plan (features/memory_plan.py): its counts against the model itself and against hand
arithmetic, and the trainer's stop before any weight loads when a setting cannot fit."""
import dataclasses
import json
import os
import subprocess

import torch

from conftest import ROOT, free_port, trainer_cmd, trainer_env
from features import memory_plan


def test_the_shape_counts_what_the_model_has_and_what_its_forward_saves(tiny_model_dir):
    """Parameters (tied ones once) and LoRA's trained ones as the built models count them; the bytes
    saved for backward per token per layer at most 15% above a real fp32 forward's (never below),
    counted here by storage address on real tensors."""
    from transformers import AutoModelForCausalLM

    from features import lora

    shape = memory_plan.model_shape(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    # parameters() yields a tie once
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.trainable == shape.params and shape.layers == model.config.num_hidden_layers
    weights = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    rows, length = 4, 96
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_decoder()(input_ids=torch.randint(100, 5000, (rows, length)))
    real = sum(saved.values()) / (rows * length * model.config.num_hidden_layers)
    # attention's plain path saves a little more
    assert real <= shape.saved_per_token_fp32 <= 1.15 * real
    adapted = lora.add_lora(model, rank=4, alpha=8, targets="all-linear", seed=0)
    lora_shape = memory_plan.model_shape(str(tiny_model_dir), lora_rank=4)
    assert lora_shape.trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert lora_shape.params == shape.params


def test_model_states_follow_deepspeeds_zero2_arithmetic():
    """bf16: 2 bytes per weight plus 18 per trained parameter over the ranks; offload leaves the
    weights alone on the GPU and 16 bytes per parameter (x DeepSpeed's 1.5 buffer) in CPU memory;
    LoRA's frozen weights cost 2 bytes each; CPU fp32: 4 + 16 / ranks."""
    shape = memory_plan.ModelShape(params=7_000_000_000, trainable=7_000_000_000, layers=28,
                                   hidden=3584, kv_width=512, vocab=152064, saved_per_token=1.0,
                                   saved_per_token_fp32=1.0)
    eight = memory_plan.Setting(ranks=8, ranks_per_node=8)
    assert memory_plan.model_states(shape, eight).trainer == 2 * 7e9 + 18 * 7e9 / 8
    offload = memory_plan.Setting(ranks=1, ranks_per_node=1, offload_optimizer=True)
    states = memory_plan.model_states(shape, offload)
    assert states.trainer == 2 * 7e9 and states.cpu == 16 * 7e9 * 1.5
    lora_shape = memory_plan.ModelShape(**{**shape.__dict__, "trainable": 40_000_000})
    assert memory_plan.model_states(lora_shape, eight).trainer == 2 * 7e9 + 18 * 40e6 // 8
    cpu = memory_plan.Setting(ranks=2, ranks_per_node=2, bf16=False)
    assert memory_plan.model_states(shape, cpu).trainer == 4 * 7e9 + 16 * 7e9 / 2


def test_activations_follow_the_micro_batch_and_checkpointing():
    """Tokens of one forward: a micro-batch's groups, each prompt once with SHARED_PREFIX; with
    gradient checkpointing, each layer's input and one layer's saved tensors."""
    shape = memory_plan.ModelShape(
        params=10,
        trainable=10,
        layers=4,
        hidden=8,
        kv_width=4,
        vocab=16,
        saved_per_token=100.0,
        saved_per_token_fp32=200.0,
    )
    base = dict(q_batch_size=4, num_pre_q=8, prompt_tokens=10, max_new_tokens=20)
    whole = memory_plan.plan(shape, memory_plan.Setting(**base), 10**12)
    tokens = 4 * 10 + 4 * 8 * 20
    assert whole[2].trainer == tokens * 4 * 100
    one_group = memory_plan.plan(shape, memory_plan.Setting(train_micro_batch=1, **base), 10**12)
    assert one_group[2].trainer == (10 + 8 * 20) * 4 * 100
    full_rows = memory_plan.plan(shape, memory_plan.Setting(shared_prefix=False, **base), 10**12)
    assert full_rows[2].trainer == 4 * 8 * 30 * 4 * 100
    kept = memory_plan.plan(shape, memory_plan.Setting(gradient_checkpointing=True, **base), 10**12)
    assert kept[2].trainer == tokens * (4 * 8 * 2 + 100)


def test_a_setting_that_cannot_fit_stops_before_any_weight_loads(tiny_model_dir, tmp_path):
    """Answers of 10 million tokens: the plan says "does not fit", the trainer prints the table and
    stops with advice; no weights were loaded and OUTPUT_DIR holds nothing."""
    out = tmp_path / "out"
    env = trainer_env(tiny_model_dir, f"http://127.0.0.1:{free_port()}", out, MAX_NEW_TOKENS=10**7)
    run = subprocess.run(
        trainer_cmd(1), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert "does not fit" in text and "activations of" in text
    assert "the memory plan above does not fit" in text and "OFFLOAD_OPTIMIZER=1" in text
    assert "Loading weights" not in text
    assert not out.exists() or not os.listdir(out)


def test_vllm_takes_its_share_of_a_gpu_and_its_weights_and_cache_on_a_cpu():
    """GPU: VLLM_GPU_MEMORY of the device, held through the step. CPU: its own fp32 weights and
    VLLM_CPU_KV_GB of cache, not a share of the machine's RAM."""
    shape = memory_plan.ModelShape(
        params=1000,
        trainable=1000,
        layers=2,
        hidden=8,
        kv_width=4,
        vocab=16,
        saved_per_token=1.0,
        saved_per_token_fp32=2.0,
    )
    gpu = memory_plan.plan(shape, memory_plan.Setting(use_vllm=True, vllm_gpu_memory=0.3), 10**10)
    assert gpu[4].trainer == 3 * 10**9
    cpu = memory_plan.plan(
        shape, memory_plan.Setting(use_vllm=True, bf16=False, vllm_cpu_kv_gb=2.0), 10**10
    )
    assert cpu[4].trainer == 4 * 1000 + 2 * 2**30


def test_the_verdict_reads_the_cpu_column_and_the_ds_configs_bucket(tmp_path):
    """Qwen2.5-7B's shape with OFFLOAD_OPTIMIZER on one 80 GB GPU: the GPU side fits, but AdamW's
    168 GB of CPU state (DeepSpeed's estimate) does not fit a host with 64 GiB of RAM, and does fit
    one with 512 GiB. On CPU ranks the offloaded state counts in the rank's own RAM share. The
    gradient bucket is DS_CONFIG's reduce_bucket_size when it sets one."""
    shape = memory_plan.ModelShape(
        params=7_600_000_000,
        trainable=7_600_000_000,
        layers=28,
        hidden=3584,
        kv_width=512,
        vocab=152064,
        saved_per_token=1.0,
        saved_per_token_fp32=1.0,
    )
    offload = memory_plan.Setting(
        offload_optimizer=True,
        gradient_checkpointing=True,
        train_micro_batch=1,
        max_new_tokens=512,
        prompt_tokens=256,
    )
    rows = memory_plan.plan(shape, offload, 80 * 10**9)
    assert rows[-1].cpu == 16 * 7.6e9 * 1.5
    assert memory_plan.verdict(rows, 80 * 10**9) == "fits"
    assert memory_plan.verdict(rows, 80 * 10**9, cpu_bytes=64 * 2**30) == "does not fit"
    assert memory_plan.verdict(rows, 80 * 10**9, cpu_bytes=512 * 2**30) == "fits"
    assert "of the machine's RAM" in memory_plan.table(rows, 80 * 10**9, "GPU", 64 * 2**30)
    small = memory_plan.ModelShape(**{**shape.__dict__, "params": 10**8, "trainable": 10**8})
    cpu = memory_plan.Setting(bf16=False, ranks=2, ranks_per_node=2)
    on_cpu = memory_plan.plan(small, cpu, 10**12)
    with_offload = memory_plan.plan(small, dataclasses.replace(cpu, offload_optimizer=True), 10**12)
    assert with_offload[-1].trainer == on_cpu[-1].trainer  # the same bytes, in the same RAM
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e7}}))
    setting = memory_plan.setting_from({"DS_CONFIG": str(config)})
    assert setting.reduce_bucket_size == 20_000_000
    shipped = memory_plan.setting_from({"DS_CONFIG": "ds_config.json"})  # it sets none
    assert shipped.reduce_bucket_size == 500_000_000
