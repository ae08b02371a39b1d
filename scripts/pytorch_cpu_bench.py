"""The PyTorch side of trainkit's CPU benchmark (docs/benchmarks.md).

A full training step in f32 -- forward, backward, global-norm clipping at 1.0, AdamW
(lr 6e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1) -- on Hugging Face's
GPT2LMHeadModel (shapes a, b) or LlamaForCausalLM (shape c: grouped-query attention, an
untied head) with the shapes of `cargo run --release --example cpu_bench`, random
tokens, dropout off, 2 warm-up steps, then the median and the best of 7 timed steps.

    python scripts/pytorch_cpu_bench.py [--shape a|b|c|d] [--attn sdpa|eager] [--threads N]

Needs torch and transformers (any recent versions; the figures in docs/benchmarks.md name
theirs).
"""

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

SHAPES = {
    "a": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=50257, batch=8, seq=256),
    "b": dict(n_layer=6, n_head=6, n_embd=384, vocab_size=256, batch=16, seq=256),
    "c": dict(n_layer=6, n_head=6, n_kv_head=2, n_embd=384, ffn=1024, vocab_size=256,
              batch=16, seq=256),
    "d": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=256, batch=2, seq=2048),
}


def model_of(s, attn):
    if "ffn" in s:
        config = LlamaConfig(
            hidden_size=s["n_embd"],
            intermediate_size=s["ffn"],
            num_hidden_layers=s["n_layer"],
            num_attention_heads=s["n_head"],
            num_key_value_heads=s["n_kv_head"],
            head_dim=s["n_embd"] // s["n_head"],
            vocab_size=s["vocab_size"],
            max_position_embeddings=s["seq"],
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn,
        )
        return LlamaForCausalLM(config).train()
    config = GPT2Config(
        n_layer=s["n_layer"],
        n_head=s["n_head"],
        n_embd=s["n_embd"],
        vocab_size=s["vocab_size"],
        n_positions=s["seq"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
        attn_implementation=attn,
    )
    return GPT2LMHeadModel(config).train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"attention {args.attn}"
    )
    for name in args.shape or sorted(SHAPES):
        s = SHAPES[name]
        model = model_of(s, args.attn)
        assert model.config._attn_implementation == args.attn
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": 0.1},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=6e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        warmup, timed = 2, 7
        times = []
        for step in range(warmup + timed):
            x = torch.randint(0, s["vocab_size"], (s["batch"], s["seq"]))
            start = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        tokens = s["batch"] * s["seq"]
        print(
            f"shape {name}: {s['n_layer']} layers, {s['n_head']} heads, {s['n_embd']} wide, "
            f"vocab {s['vocab_size']}, batch {s['batch']} x {s['seq']}: median "
            f"{tokens / statistics.median(times):.0f} tokens/s "
            f"({statistics.median(times) * 1e3:.0f} ms/step), best {tokens / min(times):.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
