"""What one weight sync to workers costs (features/weight_sync.py) for the embedded model: the
bytes, rank 0's seconds to serialize and hash them (publish), and a worker's seconds to download,
check and load them over loopback, full weights and LoRA's adapters (no link limit: the network's
own time is bytes / link speed on top).

    python bench/bench_weight_sync.py       # ~1 minute; ROUNDS syncs, medians

Writes bench/results/weight_sync.json.
"""
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ROUNDS = 3


def main():
    import torch
    from transformers import AutoModelForCausalLM

    from features import weight_sync
    from features.embedded_model import resolve_model_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    publisher = weight_sync.WeightPublisher("127.0.0.1", port, token="")
    rows = []
    from features import lora

    for dtype, rank in ((torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 16)):
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(""), dtype=dtype)
        policy = lora.add_lora(model, rank=rank, alpha=32, targets="all-linear", seed=0)
        worker = AutoModelForCausalLM.from_pretrained(resolve_model_path(""), dtype=dtype)
        publish_s, fetch_s = [], []
        for version in range(1, ROUNDS + 1):
            start = time.perf_counter()
            weight_sync.publish_every(publisher, policy, version, 1)
            publish_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            fetcher = weight_sync.WeightFetcher(f"http://127.0.0.1:{port}", "", version - 1,
                                                max_bytes=weight_sync.weights_budget(worker),
                                                poll_s=0.01)
            while (fetched := fetcher.take()) is None:
                time.sleep(0.005)
            weight_sync.swap_in(model if rank == 0 else worker, fetched[1])
            fetch_s.append(time.perf_counter() - start)
            fetcher.stop()
        size = len(publisher.current[1])
        name = f"{dtype}" + (f", LoRA {rank} adapters" if rank else "")
        rows.append({"weights": name, "bytes": size, "publish_s": statistics.median(publish_s),
                     "fetch_and_swap_s": statistics.median(fetch_s)})
        print(
            f"{name:<32} {size / 1e6:8.1f} MB | publish (serialize + sha256) "
            f"{rows[-1]['publish_s']:.2f} s | download + check + swap in "
            f"{rows[-1]['fetch_and_swap_s']:.2f} s",
            flush=True,
        )
    publisher.stop()
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "weight_sync.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
