"""PyTorch's scaled_dot_product_attention at the shapes of examples/attention_bench.rs.

Causal attention, forward and backward, on each SDPA backend PyTorch has on this GPU
(flash, cuDNN, memory-efficient), timed with CUDA events: the median of --iters timings,
each of 5 calls. Queries, keys and values are views of one fused [B, T, H + 2·KV, D]
projection, as a GPT-2 or Llama layer has them. Grouped heads use enable_gqa where the
backend takes it, else keys and values expanded to every query head before timing (said
in the output). TFLOP/s by the published convention: causal forward 2·B·H·T²·D, backward
2.5 times that.

    python3 attention_sdpa.py [--iters 20] [--dtype bf16|f16] [--json FILE]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [
    ("gpt2-124m", 8, 1024, 12, 12, 64),
    ("llama-3.2-1b", 4, 2048, 32, 8, 64),
    ("llama-3.1-8b", 4, 2048, 32, 8, 128),
]

BACKENDS = [
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
]


def timed(fn, iters, calls=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end) / calls)
    ms.sort()
    return ms[len(ms) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--json")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name, b, t, h, kv, d in SHAPES:
        torch.manual_seed(0)
        qkv = torch.randn(b, t, h + 2 * kv, d, device="cuda", dtype=dtype, requires_grad=True)
        dout = torch.randn(b, h, t, d, device="cuda", dtype=dtype)
        flops = 2.0 * b * h * d * t * t
        for label, backend in BACKENDS:
            q = qkv[:, :, :h].transpose(1, 2)
            k = qkv[:, :, h : h + kv].transpose(1, 2)
            v = qkv[:, :, h + kv :].transpose(1, 2)
            note = ""
            gqa = kv != h

            def attend(q=q, k=k, v=v, gqa=gqa):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            try:
                with sdpa_kernel(backend):
                    out = attend()
            except Exception:
                if not gqa:
                    print(f"{name:<13} {label:<9} not available for this shape")
                    continue
                # This backend takes no grouped heads: expand them first, as HF's repeat_kv.
                k = k.repeat_interleave(h // kv, dim=1)
                v = v.repeat_interleave(h // kv, dim=1)
                note = " (keys and values expanded to every head)"

                def attend(q=q, k=k, v=v):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                try:
                    with sdpa_kernel(backend):
                        out = attend()
                except Exception as e:
                    print(f"{name:<13} {label:<9} not available: {str(e).splitlines()[0][:100]}")
                    continue
            with sdpa_kernel(backend):
                fwd = timed(lambda: attend(), a.iters)
                out = attend()
                # The kernel's gradients of q, k and v (not gathered into the fused
                # projection's gradient, which a model's autograd adds a copy for).
                ins = (q, k, v)
                bwd = timed(
                    lambda: torch.autograd.grad(out, ins, dout, retain_graph=True), a.iters
                )
            for direction, ms, f in [("forward", fwd, flops), ("backward", bwd, 2.5 * flops)]:
                tflops = f / (ms * 1e-3) / 1e12
                print(
                    f"{name:<13} B={b} T={t} H={h} KV={kv} D={d} {a.dtype} sdpa-{label:<9} "
                    f"{direction:<8} {ms:8.3f} ms {tflops:7.1f} TFLOP/s{note}"
                )
                rows.append(
                    dict(shape=name, b=b, t=t, h=h, kv=kv, d=d, dtype=a.dtype,
                         impl=f"torch-sdpa-{label}", direction=direction, ms=round(ms, 4),
                         tflops=round(tflops, 2), note=note.strip(" ()"))
                )
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
