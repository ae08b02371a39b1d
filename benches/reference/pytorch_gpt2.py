"""PyTorch reference for trainkit's GPU figures: GPT-2 124M at sequence length 1024 (or
GPT-2 XL, or a Llama 3.2 1B shape, with `--model`).

A full training step -- bf16 autocast forward, f32 cross-entropy, backward, global-norm
clipping at 1.0, fused AdamW (lr 6e-4 constant, betas (0.9, 0.95), eps 1e-8, weight decay
0.1 on tensors of rank >= 2) -- on Hugging Face's GPT2LMHeadModel built from a GPT2Config
(random initialisation, dropout off: nothing is downloaded), attention through PyTorch's
scaled_dot_product_attention restricted to the flash kernel. The data is an llm.c token
file (the one `trainkit prepare` writes), cut into batches the way trainkit and llm.c cut
it: batch j, row r is the window tokens[(j*B + r)*T : (j*B + r)*T + T + 1], in order.

    python pytorch_gpt2.py --data tokens.bin [--mode eager|compile] [--batch 8]
        [--seq 1024] [--steps 50] [--warmup 3] [--json result.json]
        [--model gpt2|gpt2-medium|gpt2-large|gpt2-xl|llama-3.2-1b] [--recompute none|full]

`--model llama-3.2-1b` builds LlamaForCausalLM with Llama 3.2 1B's published shape (16
layers, 2048 wide, 32 query and 8 key/value heads, SwiGLU 8192, vocabulary 128256, tied
embeddings, rope theta 500000 with llama3 scaling), randomly initialised. `--recompute
full` turns on the model's gradient checkpointing (every layer recomputed in backward).

Prints one line per step, then a summary and a line `RESULT {json}` with the figures:
tokens/s (median and best of the timed steps, i.e. the steps after --warmup), peak memory
(torch.cuda.max_memory_allocated and max_memory_reserved), and the loss after --steps
steps. `--device cpu --tiny` runs a small model on the CPU, to try the script without a
GPU. Needs torch and transformers; works offline.
"""

import argparse
import json
import os
import statistics
import sys
import time

# Offline: the model is built from a config, and nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

GPT2_SHAPES = {
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}

TOKEN_FILE_MAGIC = 20240520
HEADER_INTS = 256


def read_tokens(path):
    """The tokens of an llm.c token file (header of 256 int32, then uint16 tokens)."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < 3 or header[0] != TOKEN_FILE_MAGIC or header[1] != 1:
        sys.exit(f"{path} is not an llm.c token file (magic {TOKEN_FILE_MAGIC}, version 1)")
    count = int(header[2])
    tokens = np.fromfile(path, dtype="<u2", offset=HEADER_INTS * 4)
    if len(tokens) != count:
        sys.exit(f"{path}: the header says {count} tokens, the file holds {len(tokens)}")
    return torch.from_numpy(tokens.astype(np.int64))


class Batches:
    """llm.c's order: consecutive windows, starting over when the next batch would run
    past the end."""

    def __init__(self, tokens, batch, seq):
        if len(tokens) < batch * seq + 1:
            sys.exit(f"{len(tokens)} tokens, but one batch of {batch} x {seq} needs more")
        self.tokens, self.batch, self.seq, self.pos = tokens, batch, seq, 0

    def next(self):
        n = self.batch * self.seq
        if self.pos + n + 1 > len(self.tokens):
            self.pos = 0
        window = self.tokens[self.pos : self.pos + n + 1]
        self.pos += n
        return window[:-1].view(self.batch, self.seq), window[1:].view(self.batch, self.seq)


def llama_config(tiny):
    """Llama 3.2 1B's published shape (or a 2-layer one with `tiny`)."""
    layers, width, heads, kv, ffn = (2, 64, 4, 2, 128) if tiny else (16, 2048, 32, 8, 8192)
    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    # transformers 5 keeps the rotary settings in `rope_parameters`, 4.x in `rope_theta`
    # and `rope_scaling`.
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:
        config.rope_theta = rope.pop("rope_theta")
        config.rope_scaling = rope
    return config


def allow_every_sdpa_kernel(allow):
    """Lets scaled_dot_product_attention choose any kernel, or (False) only flash."""
    backends = torch.backends.cuda
    backends.enable_flash_sdp(True)
    backends.enable_mem_efficient_sdp(allow)
    backends.enable_math_sdp(allow)
    if hasattr(backends, "enable_cudnn_sdp"):
        backends.enable_cudnn_sdp(allow)


def use_flash_only(device):
    """Restricts scaled_dot_product_attention to the flash kernel; returns a description,
    or why it cannot be (then every SDPA kernel stays allowed)."""
    if device != "cuda":
        return "sdpa (any kernel: flash attention needs a GPU)"
    q = torch.randn(1, 12, 64, 64, device=device, dtype=torch.bfloat16)
    allow_every_sdpa_kernel(False)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return "sdpa, flash kernel only"
    except RuntimeError as e:
        allow_every_sdpa_kernel(True)
        return f"sdpa, any kernel (flash refused: {str(e).splitlines()[0]})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="llm.c token file")
    parser.add_argument("--mode", choices=["eager", "compile"], default="eager")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, for a try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument(
        "--model", choices=[*GPT2_SHAPES, "llama-3.2-1b"], default="gpt2", help="the shape"
    )
    parser.add_argument("--recompute", choices=["none", "full"], default="none")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup (the timed steps come after the warm-up)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device answers torch.cuda.is_available()")

    torch.manual_seed(args.seed)
    device = args.device
    if args.model == "llama-3.2-1b":
        model = LlamaForCausalLM(llama_config(args.tiny)).to(device).train()
        family = "Llama 3.2 1B shape"
    else:
        n_layer, n_head, n_embd = (2, 2, 64) if args.tiny else GPT2_SHAPES[args.model]
        config = GPT2Config(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            vocab_size=50257,
            n_positions=args.seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            attn_implementation="sdpa",
        )
        model = GPT2LMHeadModel(config).to(device).train()
        family = f"GPT-2 ({args.model})"
    if args.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    attention = use_flash_only(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device == "cuda"
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=6e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )
    forward = torch.compile(model) if args.mode == "compile" else model
    data = Batches(read_tokens(args.data), args.batch, args.seq)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {gpu}, {family}, {params / 1e6:.1f}M parameters, "
        f"{args.mode}, batch {args.batch} x {args.seq}, recompute {args.recompute}, "
        f"bf16 autocast, {attention}, AdamW fused={fused}",
        flush=True,
    )

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens_per_step = args.batch * args.seq
    losses, seconds = [], []
    for step in range(1, args.steps + 1):
        x, y = data.next()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync()
        start = time.perf_counter()
        try:
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                logits = forward(input_ids=x).logits
        except RuntimeError as e:
            # The model's attention call does not fit the flash kernel (a mask passed, say):
            # say so, and let SDPA choose.
            if step > 1 or "flash kernel only" not in attention:
                raise
            allow_every_sdpa_kernel(True)
            attention = f"sdpa, any kernel (the model's call refused flash: {str(e).splitlines()[0]})"
            print(attention, flush=True)
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                logits = forward(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        sync()
        elapsed = time.perf_counter() - start
        losses.append(value)
        seconds.append(elapsed)
        print(
            f"step {step:4d}/{args.steps} | loss {value:.6f} | norm {norm.item():.4f} | "
            f"{elapsed * 1e3:.1f} ms | {tokens_per_step / elapsed:.0f} tokens/s"
            + (" (warm-up)" if step <= args.warmup else ""),
            flush=True,
        )

    timed = seconds[args.warmup :]
    result = {
        "framework": "pytorch",
        "mode": args.mode,
        "model": args.model,
        "recompute": args.recompute,
        "torch": torch.__version__,
        "device": gpu,
        "parameters": params,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "attention": attention,
        "fused_adamw": fused,
        "tokens_per_s_median": tokens_per_step / statistics.median(timed),
        "tokens_per_s_best": tokens_per_step / min(timed),
        "ms_per_step_median": statistics.median(timed) * 1e3,
        "first_step_s": seconds[0],
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
    }
    if device == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    gib = 1 << 30
    print(
        f"{args.mode}: median {result['tokens_per_s_median']:.0f} tokens/s, best "
        f"{result['tokens_per_s_best']:.0f} tokens/s over {len(timed)} timed steps; "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps"
        + (
            f"; peak allocated {result['peak_allocated_bytes'] / gib:.2f} GiB, "
            f"reserved {result['peak_reserved_bytes'] / gib:.2f} GiB"
            if device == "cuda"
            else ""
        )
    )
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "losses"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
