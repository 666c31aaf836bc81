"""What moving a group to the reference server and back costs, next to the reference forward itself.

For groups shaped like the demo's (8 answers of 64 tokens) and like a GSM8K run (16 answers of
512 tokens), on the embedded SmolLM2-135M: bytes on the wire up and down, and the time of
encode + HTTP upload + server decode/validate + HTTP download + decode, against the server's
reference forward on the same group. A real ref_server (bottle, loopback HTTP) runs in this process.

    # ~1 minute on 2 CPU cores; writes bench/results/transport.json
    python bench/bench_transport.py
"""
import json
import os
import platform
import statistics
import sys
import time

import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ref_server  # noqa: E402
from features.embedded_model import resolve_model_path  # noqa: E402
from features.wire import decode_batch, encode_batch  # noqa: E402

REPEATS = 5  # timings are medians of this many round trips


def make_group(G, plen, tc, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (G, plen + tc), generator=g)  # (G, L)
    ids[:, :plen] = ids[0, :plen]
    tensors = dict(input_ids=ids, completion_mask=torch.ones(G, tc, dtype=torch.bool),
                   advantages=torch.randn(G, generator=g), scores=torch.rand(G, generator=g),
                   pi_old_logps=-torch.rand(G, tc, generator=g))
    return tensors, {"plen": plen, "temperature": 0.7}


def main():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(""), dtype=torch.float32).eval()
    torch.set_num_threads(os.cpu_count())
    server = ref_server.RefServer(model, "SmolLM2-135M-Instruct")
    port = 59990
    stop = ref_server.serve(server, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for G, plen, tc in ((8, 110, 64), (16, 200, 512)):
            tensors, meta = make_group(G, plen, tc, server.vocab_size)
            encode, upload, download, decode, forward = [], [], [], [], []
            for _ in range(REPEATS):
                t = time.perf_counter()
                body = encode_batch(tensors, meta)
                encode.append(time.perf_counter() - t)
                t = time.perf_counter()
                # includes the server's decode + validate
                r = requests.post(url + "/upload", data=body, timeout=60)
                upload.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
                # the forward runs meanwhile; the download is timed from the moment it is ready
                while True:
                    if server.ready.qsize():
                        break
                    time.sleep(0.001)
                t = time.perf_counter()
                r = requests.get(url + "/get", timeout=60)
                download.append(time.perf_counter() - t)
                t = time.perf_counter()
                back, _ = decode_batch(r.content)
                decode.append(time.perf_counter() - t)
                t = time.perf_counter()
                # the same work the worker thread did
                server.reference_logps(tensors["input_ids"], plen, 0.7)
                forward.append(time.perf_counter() - t)
            med = {
                k: statistics.median(v)
                for k, v in dict(
                    encode=encode, upload=upload, download=download, decode=decode, forward=forward
                ).items()
            }
            transport = med["encode"] + med["upload"] + med["download"] + med["decode"]
            row = dict(
                G=G,
                prompt_tokens=plen,
                completion_tokens=tc,
                bytes_up=len(body),
                bytes_down=len(r.content),
                **{f"{k}_ms": round(v * 1000, 2) for k, v in med.items()},
                transport_ms=round(transport * 1000, 2),
                transport_over_forward=round(transport / med["forward"], 4),
            )
            results.append(row)
            print(
                f"G={G:2d} L={plen + tc:4d}: up {len(body) / 1024:7.1f} KiB, down "
                f"{len(r.content) / 1024:7.1f} KiB | "
                f"encode {med['encode'] * 1e3:5.1f} ms, upload {med['upload'] * 1e3:5.1f} ms, "
                f"download {med['download'] * 1e3:5.1f} ms, decode {med['decode'] * 1e3:5.1f} ms | "
                f"reference forward {med['forward'] * 1e3:7.1f} ms | transport / forward = "
                f"{transport / med['forward']:.2%}"
            )
    finally:
        stop()
    out = os.path.join(ROOT, "bench", "results", "transport.json")
    with open(out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
                "command": "python bench/bench_transport.py",
                "target": "transport <= 2% of the reference forward",
                "results": results,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
