"""PyTorch's LayerNorm, RMSNorm and fused AdamW at the shapes of examples/kernel_bench.rs.

LayerNorm forward and backward (GPT-2 124M: 8 x 1024 rows of 768) and RMSNorm forward and
backward (Llama 3.2 1B: 8 x 1024 rows of 2048) in bf16 (`F.layer_norm`, `F.rms_norm`, the
gradients of the input, the gain and the bias by `torch.autograd.grad` over a kept graph),
and `torch.optim.AdamW(fused=True)` over tensors of GPT-2 124M's parameter shapes (f32
values, gradients and moments: 28 bytes an element, no compute copy). Milliseconds per call
(the median of --iters timings of 5 calls between two synchronizations), the bytes counted
as kernel_bench counts them, and the rate against --bandwidth GB/s.

    python benches/reference/norms_adamw.py [--iters 20] [--bandwidth 3350] [--json FILE]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F


def timed(fn, iters):
    calls = 5
    for _ in range(2):
        fn()
    ms = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - start) * 1e3 / calls)
    ms.sort()
    return ms[len(ms) // 2]


def gpt2_shapes():
    """GPT-2 124M's parameters as trainkit holds them (the vocabulary padded to 50304, the
    head tied to the embedding)."""
    c, f, layers = 768, 3072, 12
    shapes = [(50304, c), (1024, c)]
    for _ in range(layers):
        shapes += [(c,), (c,), (c, 3 * c), (3 * c,), (c, c), (c,), (c,), (c,), (c, f), (f,),
                   (f, c), (c,)]
    return shapes + [(c,), (c,)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=3350.0, help="the device's GB/s")
    ap.add_argument("--json", help="write the rows as JSON lines")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    dev, bf16 = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    rows = []

    n, c = 8 * 1024, 768
    x = torch.randn(n, c, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(c, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(c, device=dev, dtype=bf16, requires_grad=True)
    dout = torch.randn(n, c, device=dev, dtype=bf16)
    e = n * c * 2
    with torch.no_grad():
        ms = timed(lambda: F.layer_norm(x, (c,), w, b, 1e-5), args.iters)
    rows.append(("layernorm forward", f"{n} x {c} bf16", ms, 2 * e + n * 8))
    out = F.layer_norm(x, (c,), w, b, 1e-5)
    ms = timed(lambda: torch.autograd.grad(out, (x, w, b), dout, retain_graph=True), args.iters)
    # dout and x read, dx written (PyTorch writes it fresh; trainkit accumulates).
    rows.append(("layernorm backward", f"{n} x {c} bf16", ms, 3 * e + n * 8))

    n, c = 8 * 1024, 2048
    x = torch.randn(n, c, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(c, device=dev, dtype=bf16, requires_grad=True)
    dout = torch.randn(n, c, device=dev, dtype=bf16)
    e = n * c * 2
    with torch.no_grad():
        ms = timed(lambda: F.rms_norm(x, (c,), w, 1e-5), args.iters)
    rows.append(("rmsnorm forward", f"{n} x {c} bf16", ms, 2 * e + n * 4))
    out = F.rms_norm(x, (c,), w, 1e-5)
    ms = timed(lambda: torch.autograd.grad(out, (x, w), dout, retain_graph=True), args.iters)
    rows.append(("rmsnorm backward", f"{n} x {c} bf16", ms, 3 * e + n * 4))

    params = [torch.randn(s, device=dev, requires_grad=True) for s in gpt2_shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    elements = sum(p.numel() for p in params)
    ms = timed(opt.step, args.iters)
    rows.append(("adamw", f"gpt2 124M, {elements} f32 elements, {len(params)} tensors", ms,
                 28 * elements))

    out = open(args.json, "w") if args.json else None
    for kernel, shape, ms, nbytes in rows:
        gbs = nbytes / (ms * 1e-3) / 1e9
        pct = 100 * gbs / args.bandwidth
        print(f"{kernel:<20} {shape:<44} {ms:9.4f} ms {gbs:8.0f} GB/s {pct:5.1f}% of "
              f"{args.bandwidth:.0f} GB/s")
        if out:
            out.write(json.dumps({"kernel": kernel, "impl": "pytorch", "shape": shape,
                                  "ms": round(ms, 4), "bytes": nbytes, "gb_s": round(gbs, 1),
                                  "pct_of_bandwidth": round(pct, 1)}) + "\n")


if __name__ == "__main__":
    main()
