"""trainkit against Hugging Face transformers (PyTorch), an independent GPT-2, Llama,
Qwen2 and Qwen3.

Checks, on a small GPT-2 and llm.c-style batches of a text:
1. transformers' GPT2LMHeadModel.from_pretrained loads a directory trainkit saved;
2. its loss on the same windows equals `trainkit eval --json`;
3. after a few AdamW steps from the same initial weights (constant learning rate, global
   norm clipping, weight decay on matrices and embeddings only), PyTorch's weights equal
   trainkit's;
4. trainkit loads what `save_pretrained` writes, and `trainkit eval` on it equals
   PyTorch's loss.

and on small Llamas made by transformers (grouped-query attention with 1 and 2 key/value
heads and all of them, llama3 and linear rope scaling, tied and untied heads): trainkit
loads the `save_pretrained` directory, its loss equals `LlamaForCausalLM`'s, and after a
few AdamW steps from it the losses and weights (saved under Hugging Face's names, which
transformers loads back) equal PyTorch's. The same for small Qwen2 models (q/k/v biases)
and Qwen3 models (per-head q/k norm, heads wider than hidden / heads), tied and untied.

And every family's adapters in PEFT: an `all-linear` LoRA, a DoRA trained with dropout, and
the head and norms (untied) or the tied embedding (ensure_weight_tying) saved whole, on GPT-2, Llama, Qwen2 and Qwen3 made by
transformers: `PeftModel.from_pretrained` gives `trainkit eval --adapter`'s loss.

And LoRA, then DoRA (`--use-dora`; PEFT's own DoRA also starts its magnitudes where
trainkit's do), against PEFT, on a small Llama made by transformers: PEFT loads the adapter
trainkit starts from (`train --steps 0`), three AdamW steps of the adapter alone give the
same losses and adapter weights on both sides, `PeftModel.from_pretrained` on trainkit's
trained adapter gives `trainkit eval --adapter`'s loss, and trainkit evaluates the adapter
PEFT saved as PEFT does.

And chat data against transformers' `apply_chat_template`: a byte-level BPE tokenizer
with ChatML's special tokens and a template whose assistant turns are `{% generation %}`
blocks; `trainkit prepare --chat` writes the token ids `apply_chat_template` gives and
trains exactly the positions of its `assistant_masks`.

And document masking against each document run alone, in float64: rows that hold several
documents, each ending at a separator (`train --document-mask --separator-id`), on a GPT-2
(learned positions) and a Llama (rotary) made by transformers: trainkit's loss of one step
(and `eval --document-mask`) is the token-weighted mean of the documents' solo losses, and
its gradient (read back from one plain SGD step of learning rate 1) their token-weighted
mean gradient; the position holding a separator predicts nothing.

Not part of `cargo test` (it needs PyTorch): run it by hand, with a Python that has
torch, transformers, peft, safetensors and numpy installed:

    cargo build --release
    python tests/hf_parity/check.py [--trainkit target/release/trainkit] [--text FILE]

Exits non-zero when a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from transformers import (GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

B, T, STEPS, LR, WD, CLIP = 4, 32, 3, 1e-3, 0.1, 1.0
# AdamW's second-moment decay of every run here: trainkit's fine-tuning default (a run that
# starts from a model, --init-from), Hugging Face's TrainingArguments' adam_beta2.
BETA2 = 0.999


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return out.stdout


def windows(tokens, step, micro=1):
    """llm.c's batch `step`: rows of T+1 consecutive tokens, moving through the file."""
    start = step * B * T * micro
    rows = [tokens[start + r * T: start + r * T + T + 1] for r in range(B)]
    a = torch.tensor(np.array(rows, dtype=np.int64))
    return a[:, :-1], a[:, 1:]


def loss_of(model, x, y):
    logits = model(x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainkit", default="target/release/trainkit")
    ap.add_argument("--text", default="../shared/data/tinyshakespeare.txt")
    args = ap.parse_args()
    tk = args.trainkit
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="trainkit-hf-")
    text = os.path.join(work, "text.txt")
    with open(args.text, encoding="utf-8") as f:
        open(text, "w", encoding="utf-8").write(f.read()[:40000])
    tokens_bin = os.path.join(work, "tokens.bin")
    run([tk, "prepare", "--text", text, "--out", tokens_bin, "--tokenizer", "bytes",
         "--val-fraction", "0"])
    raw = np.fromfile(tokens_bin, dtype=np.uint16, offset=1024)
    tokens = raw.astype(np.int64)

    shape = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--vocab-size", "256"]
    init = os.path.join(work, "init")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--steps", "0", "--out", init, "--seq-len", str(T), "--batch-size", str(B)] + shape)

    # 1. transformers loads it.
    model = GPT2LMHeadModel.from_pretrained(init, dtype=torch.float32)
    model.eval()
    ours = load_file(os.path.join(init, "model.safetensors"))
    ok = True

    # 2. The same loss on the same windows.
    k = 3
    tk_eval = json.loads(run([tk, "eval", "--model", init, "--data", tokens_bin,
                              "--tokenizer", "bytes", "--batch-size", str(B), "--seq-len",
                              str(T), "--batches", str(k), "--json", "--device", "cpu"]))
    with torch.no_grad():
        hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
    d = abs(hf - tk_eval["loss"])
    print(f"eval loss: transformers {hf:.7f}, trainkit {tk_eval['loss']:.7f}, diff {d:.2e}")
    ok &= d < 1e-5

    # 3. A few AdamW steps from the same weights.
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, BETA2), eps=1e-8)
    hf_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, *windows(tokens, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        hf_losses.append(loss.item())
    trained = os.path.join(work, "trained")
    log = os.path.join(work, "log.jsonl")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", init, "--steps", str(STEPS), "--out", trained, "--seq-len", str(T),
         "--batch-size", str(B), "--lr", str(LR), "--lr-schedule", "constant",
         "--warmup-steps", "0", "--weight-decay", str(WD), "--grad-clip", str(CLIP),
         "--eval-every", "0", "--log-json", log])
    tk_losses = [json.loads(line)["loss"] for line in open(log)]
    for i, (a, b) in enumerate(zip(hf_losses, tk_losses)):
        print(f"step {i + 1} loss: transformers {a:.7f}, trainkit {b:.7f}, diff {abs(a - b):.2e}")
        ok &= abs(a - b) < 1e-5
    after = load_file(os.path.join(trained, "model.safetensors"))
    state = dict(model.named_parameters())
    worst, worst_name = 0.0, ""
    for name, w in after.items():
        ref = state[name].detach().numpy()
        moved = np.abs(ours[name] - ref).max()
        diff = np.abs(w - ref).max()
        if diff > worst:
            worst, worst_name = diff, name
        assert moved > 0 or name.endswith("bias") or "ln_" in name, name
    print(f"weights after {STEPS} steps: max |diff| {worst:.2e} ({worst_name}); "
          f"the step moved them by about {LR:.0e}")
    ok &= worst < 2e-5

    # 4. What transformers saves, trainkit reads.
    saved = os.path.join(work, "hf_saved")
    model.save_pretrained(saved)
    model.eval()
    with torch.no_grad():
        hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
    tk_eval = json.loads(run([tk, "eval", "--model", saved, "--data", tokens_bin,
                              "--tokenizer", "bytes", "--batch-size", str(B), "--seq-len",
                              str(T), "--batches", str(k), "--json", "--device", "cpu"]))
    d = abs(hf - tk_eval["loss"])
    print(f"save_pretrained -> trainkit eval: transformers {hf:.7f}, trainkit "
          f"{tk_eval['loss']:.7f}, diff {d:.2e}")
    ok &= d < 1e-5
    for kv, tied, rope in [
        (2, True, {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                   "original_max_position_embeddings": 16}),
        (1, False, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        (4, False, {"rope_type": "default", "rope_theta": 500.0}),
    ]:
        ok &= check_llama(tk, work, tokens_bin, tokens, kv, tied, rope)
    for tied in [True, False]:
        ok &= check_qwen(tk, work, tokens_bin, tokens, 2, tied)
        ok &= check_qwen(tk, work, tokens_bin, tokens, 3, tied)
    ok &= check_lora(tk, work, tokens_bin, tokens)
    ok &= check_lora(tk, work, tokens_bin, tokens, dora=True)
    ok &= check_adapters_in_peft(tk, work, tokens_bin, tokens)
    ok &= check_qlora(tk, work, tokens_bin, tokens)
    ok &= check_chat(tk, work, args.text)
    ok &= check_documents(tk, work)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


def adamw(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, BETA2), eps=1e-8)


def check_llama(tk, work, tokens_bin, tokens, kv, tied, rope):
    """A Llama made and saved by transformers: trainkit's loss and AdamW steps on it."""
    what = f"llama kv={kv} tied={tied} rope={rope['rope_type']}"
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv, head_dim=16,
                         vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=tied, rope_parameters=rope,
                         attn_implementation="eager")
    torch.manual_seed(kv)
    return check_hf(tk, work, tokens_bin, tokens, LlamaForCausalLM, config, what,
                    f"llama-{kv}-{tied}")


def check_qwen(tk, work, tokens_bin, tokens, version, tied):
    """A Qwen2 (q/k/v biases) or Qwen3 (q/k norm, heads of 32 in a model 64 wide with 4
    heads) made and saved by transformers: trainkit's loss and AdamW steps on it."""
    what = f"qwen{version} tied={tied}"
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  use_sliding_window=False, attn_implementation="eager")
    torch.manual_seed(10 + version)
    if version == 2:
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, cls = Qwen3Config(head_dim=32, attention_bias=False, **common), Qwen3ForCausalLM
    model = cls(config).float()
    # transformers starts biases at zero and norm gains at one: move them, so the check
    # sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return check_hf(tk, work, tokens_bin, tokens, cls, config, what,
                    f"qwen{version}-{tied}", model)


def check_hf(tk, work, tokens_bin, tokens, cls, config, what, tag, model=None):
    """A model of `cls` (made from `config` unless given), saved by transformers: trainkit's
    loss, AdamW steps, and transformers loading trainkit's weights back."""
    if model is None:
        model = cls(config).float()
    init = os.path.join(work, tag)
    model.save_pretrained(init)
    model.eval()
    k, ok = 3, True
    tk_eval = json.loads(run([tk, "eval", "--model", init, "--data", tokens_bin,
                              "--tokenizer", "bytes", "--batch-size", str(B), "--seq-len",
                              str(T), "--batches", str(k), "--json", "--device", "cpu"]))
    with torch.no_grad():
        hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
    d = abs(hf - tk_eval["loss"])
    print(f"{what}: eval loss transformers {hf:.7f}, trainkit {tk_eval['loss']:.7f}, "
          f"diff {d:.2e}")
    ok &= d < 1e-5
    model.train()
    opt = adamw(model)
    hf_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, *windows(tokens, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        hf_losses.append(loss.item())
    trained = init + "-trained"
    log = os.path.join(work, f"log-{tag}.jsonl")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", init, "--steps", str(STEPS), "--out", trained, "--seq-len", str(T),
         "--batch-size", str(B), "--lr", str(LR), "--lr-schedule", "constant",
         "--warmup-steps", "0", "--weight-decay", str(WD), "--grad-clip", str(CLIP),
         "--eval-every", "0", "--log-json", log])
    tk_losses = [json.loads(line)["loss"] for line in open(log)]
    for i, (a, b) in enumerate(zip(hf_losses, tk_losses)):
        print(f"{what}: step {i + 1} loss transformers {a:.7f}, trainkit {b:.7f}, "
              f"diff {abs(a - b):.2e}")
        ok &= abs(a - b) < 1e-5
    after = load_file(os.path.join(trained, "model.safetensors"))
    state = {n: p.detach().numpy() for n, p in model.named_parameters()}
    missing = [n for n in state if n not in after]
    ok &= not missing
    worst, worst_name, loose, total = 0.0, "", 0, 0
    for name, w in after.items():
        d = np.abs(w - state[name])
        loose += int((d > 2e-5).sum())
        total += d.size
        if d.max() > worst:
            worst, worst_name = d.max(), name
    print(f"{what}: weights after {STEPS} steps max |diff| {worst:.2e} ({worst_name}), "
          f"{loose} of {total} elements above 2e-5"
          f"{'; missing ' + str(missing) if missing else ''}")
    # AdamW divides by √v: an element whose gradient nearly vanishes in one of the steps
    # turns the f32 rounding of that gradient into a visible part of its update. Such
    # elements are rare (one in ~100,000 here); every other weight agrees within 2e-5.
    ok &= worst < 1e-4 and loose <= max(1, total // 10_000)
    # transformers loads what trainkit saved.
    back = cls.from_pretrained(trained, dtype=torch.float32)
    for name, p in back.named_parameters():
        ok &= np.array_equal(p.detach().numpy(), after[name])
    return ok


def adapter_steps(model, trainable, tokens):
    """STEPS AdamW steps of a PEFT model's adapter, with trainkit's settings: the losses."""
    # trainkit decays matrices alone (DoRA's magnitude vectors are not).
    decay = [p for p in trainable if p.dim() >= 2]
    rest = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, BETA2), eps=1e-8)
    model.train()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, *windows(tokens, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def check_lora(tk, work, tokens_bin, tokens, dora=False):
    """LoRA (or DoRA) on every projection of a small Llama, trainkit against PEFT."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

    what = "dora" if dora else "lora"
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         attn_implementation="eager")
    torch.manual_seed(7)
    base_dir = os.path.join(work, f"{what}-base")
    LlamaForCausalLM(config).float().save_pretrained(base_dir)
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", targets]
    lora += ["--use-dora"] if dora else []
    shape = ["--seq-len", str(T), "--batch-size", str(B)]
    # trainkit's initial adapter: A drawn, B zero (DoRA: the magnitudes the base rows' norms).
    start = os.path.join(work, f"{what}-start")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", base_dir, "--steps", "0", "--out", start] + lora + shape)
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, start, is_trainable=True)
    ok = True
    trainable = [p for p in model.parameters() if p.requires_grad]
    ok &= len(trainable) == 2 * (3 if dora else 2) * 7
    if dora:
        # PEFT's own DoRA starts its magnitudes where trainkit's do.
        own = get_peft_model(
            LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
            LoraConfig(r=4, lora_alpha=8, target_modules=targets.split(","), use_dora=True))
        own = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(own).items()
               if k.endswith("lora_magnitude_vector")}
        mine = {k: v for k, v in load_file(os.path.join(start, "adapter_model.safetensors"))
                .items() if k.endswith("lora_magnitude_vector")}
        ok &= sorted(own) == sorted(mine) and len(own) == 2 * 7
        d = max(np.abs(own[k] - mine[k]).max() / np.abs(own[k]).max() for k in own)
        print(f"{what}: starting magnitudes, PEFT's against trainkit's: max relative "
              f"|diff| {d:.2e} over {len(own)} modules")
        ok &= d < 1e-6
    hf_losses = adapter_steps(model, trainable, tokens)
    trained = os.path.join(work, f"{what}-trained")
    log = os.path.join(work, f"log-{what}.jsonl")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", base_dir, "--adapter", start, "--steps", str(STEPS), "--out", trained,
         "--lr", str(LR), "--lr-schedule", "constant", "--warmup-steps", "0",
         "--weight-decay", str(WD), "--grad-clip", str(CLIP), "--eval-every", "0",
         "--log-json", log] + shape)
    tk_losses = [json.loads(line)["loss"] for line in open(log)]
    for i, (a, b) in enumerate(zip(hf_losses, tk_losses)):
        print(f"{what}: step {i + 1} loss PEFT {a:.7f}, trainkit {b:.7f}, diff {abs(a - b):.2e}")
        ok &= abs(a - b) < 1e-5
    ours = load_file(os.path.join(trained, "adapter_model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(model).items()}
    ok &= sorted(ours) == sorted(theirs)
    worst, worst_name = 0.0, ""
    for name, w in ours.items():
        d = np.abs(w - theirs[name]).max()
        if d > worst:
            worst, worst_name = d, name
    print(f"{what}: adapter after {STEPS} steps max |diff| {worst:.2e} ({worst_name}) over "
          f"{len(ours)} tensors")
    ok &= worst < 2e-5
    k = 3
    # PEFT loads trainkit's trained adapter: the same loss as trainkit's.
    fresh = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32), trained)
    fresh.eval()
    with torch.no_grad():
        hf = np.mean([loss_of(fresh, *windows(tokens, i)).item() for i in range(k)])
    tk_eval = json.loads(run([tk, "eval", "--model", base_dir, "--adapter", trained, "--data",
                              tokens_bin, "--tokenizer", "bytes", "--batch-size", str(B),
                              "--seq-len", str(T), "--batches", str(k), "--json", "--device",
                              "cpu"]))
    d = abs(hf - tk_eval["loss"])
    print(f"{what}: trainkit's adapter in PEFT: eval loss PEFT {hf:.7f}, trainkit "
          f"{tk_eval['loss']:.7f}, diff {d:.2e}")
    ok &= d < 1e-5
    # trainkit reads what PEFT saves.
    saved = os.path.join(work, f"{what}-peft-saved")
    model.save_pretrained(saved)
    model.eval()
    with torch.no_grad():
        hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
    tk_eval = json.loads(run([tk, "eval", "--model", base_dir, "--adapter", saved, "--data",
                              tokens_bin, "--tokenizer", "bytes", "--batch-size", str(B),
                              "--seq-len", str(T), "--batches", str(k), "--json", "--device",
                              "cpu"]))
    d = abs(hf - tk_eval["loss"])
    print(f"{what}: PEFT's save_pretrained in trainkit: eval loss PEFT {hf:.7f}, trainkit "
          f"{tk_eval['loss']:.7f}, diff {d:.2e}")
    ok &= d < 1e-5
    # `trainkit merge`: transformers loads the merged directory, and its logits are those of
    # PEFT's merge_and_unload of the same adapter.
    merged = os.path.join(work, f"{what}-merged")
    run([tk, "merge", "--model", base_dir, "--adapter", trained, "--out", merged])
    ours_merged = LlamaForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    theirs_merged = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32), trained
    ).merge_and_unload().eval()
    x, _ = windows(tokens, 0)
    with torch.no_grad():
        d = (ours_merged(x).logits - theirs_merged(x).logits).abs().max().item()
    print(f"{what}: trainkit merge in transformers against PEFT's merge_and_unload: "
          f"max |logit diff| {d:.2e}")
    ok &= d < 1e-5
    return ok


def check_adapters_in_peft(tk, work, tokens_bin, tokens):
    """Every family's adapters as PEFT loads them: trainkit trains an `all-linear` LoRA, a
    DoRA with dropout and modules trained whole beside the adapter (PEFT's modules_to_save:
    an untied model's head and norms, a tied model's embedding with ensure_weight_tying), on GPT-2 (Conv1D, fan_in_fan_out), Llama, Qwen2 and Qwen3 made
    by transformers; `PeftModel.from_pretrained` on each gives `trainkit eval --adapter`'s
    loss."""
    from peft import PeftModel

    from transformers import GPT2Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  attn_implementation="eager")
    families = [
        ("gpt2", GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256,
                                             n_positions=64, attn_implementation="eager")),
        ("llama", LlamaForCausalLM, LlamaConfig(head_dim=16, tie_word_embeddings=True,
                                                **common)),
        ("qwen2", Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=False,
                                                use_sliding_window=False, **common)),
        ("qwen3", Qwen3ForCausalLM, Qwen3Config(head_dim=32, tie_word_embeddings=True,
                                                use_sliding_window=False, **common)),
    ]
    ok, k = True, 3
    for name, cls, config in families:
        torch.manual_seed(21)
        base_dir = os.path.join(work, f"peft-{name}-base")
        cls(config).float().save_pretrained(base_dir)
        variants = [("lora all-linear", []),
                    ("dora, dropout 0.05", ["--use-dora", "--lora-dropout", "0.05"])]
        if not config.tie_word_embeddings:
            variants.append(("lora, lm_head and norms saved", ["--modules-to-save",
                                                                "lm_head,norm"]))
        else:
            # The embedding the head shares, trained whole once for both (PEFT's
            # ensure_weight_tying).
            embedding = "wte" if name == "gpt2" else "embed_tokens"
            variants.append(("lora, the tied embedding saved", ["--modules-to-save",
                                                                 embedding]))
        for label, flags in variants:
            out = os.path.join(work, f"peft-{name}-{len(flags)}")
            run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
                 "--init-from", base_dir, "--lora-rank", "4", "--lora-targets", "all-linear",
                 "--steps", "3", "--lr", "1e-2", "--eval-every", "0", "--out", out,
                 "--seq-len", str(T), "--batch-size", str(B)] + flags)
            model = PeftModel.from_pretrained(cls.from_pretrained(base_dir, dtype=torch.float32),
                                              out).eval()
            with torch.no_grad():
                hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
                plain = cls.from_pretrained(base_dir, dtype=torch.float32).eval()
                base = np.mean([loss_of(plain, *windows(tokens, i)).item() for i in range(k)])
            tk_eval = json.loads(run([tk, "eval", "--model", base_dir, "--adapter", out,
                                      "--data", tokens_bin, "--tokenizer", "bytes",
                                      "--batch-size", str(B), "--seq-len", str(T), "--batches",
                                      str(k), "--json", "--device", "cpu"]))
            d = abs(hf - tk_eval["loss"])
            print(f"peft {name} {label}: eval loss PEFT {hf:.7f}, trainkit "
                  f"{tk_eval['loss']:.7f}, diff {d:.2e} (the base {base:.7f})")
            ok &= d < 1e-5 and abs(hf - base) > 1e-3
        if name == "llama":
            # What PEFT saves with a tied embedding trained whole, trainkit reads.
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(cls.from_pretrained(base_dir, dtype=torch.float32),
                                   LoraConfig(r=4, target_modules=["q_proj"],
                                              modules_to_save=["embed_tokens"],
                                              ensure_weight_tying=True))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        p.add_(0.05 * torch.randn_like(p))
            saved = os.path.join(work, "peft-llama-tied-saved")
            model.save_pretrained(saved)
            model.eval()
            with torch.no_grad():
                hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
            tk_eval = json.loads(run([tk, "eval", "--model", base_dir, "--adapter", saved,
                                      "--data", tokens_bin, "--tokenizer", "bytes",
                                      "--batch-size", str(B), "--seq-len", str(T), "--batches",
                                      str(k), "--json", "--device", "cpu"]))
            d = abs(hf - tk_eval["loss"])
            print(f"peft llama: PEFT's adapter with the tied embedding saved, in trainkit: "
                  f"eval loss PEFT {hf:.7f}, trainkit {tk_eval['loss']:.7f}, diff {d:.2e}")
            ok &= d < 1e-5
    return ok


def check_qlora(tk, work, tokens_bin, tokens):
    """QLoRA on every projection of a small Llama: trainkit's NF4 base against
    transformers' bitsandbytes 4-bit model (nf4, double quantization, f32 compute), as
    bitsandbytes quantizes it and with the reference absmax codes; then 3 AdamW steps of
    the adapter against PEFT's over the latter."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import BitsAndBytesConfig

    what = "qlora"
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         attn_implementation="eager")
    torch.manual_seed(11)
    base_dir = os.path.join(work, "qlora-base")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(base_dir)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)

    def quantized(reference_absmax):
        """transformers' 4-bit model; with `reference_absmax`, each module's double-quantized
        absmax codes recomputed by bitsandbytes' reference algorithm (nf4_fixture.py), which
        trainkit follows: on the CPU, bitsandbytes' C library picks a neighbouring code for
        a few absmaxes."""
        m = LlamaForCausalLM.from_pretrained(base_dir, quantization_config=nf4,
                                             device_map="cpu", dtype=torch.float32)
        if not reference_absmax:
            return m
        from nf4_fixture import nested_absmax
        from safetensors.torch import load_file as load_torch
        weights = load_torch(os.path.join(base_dir, "model.safetensors"))
        differ = 0
        for name, module in m.named_modules():
            qs = getattr(getattr(module, "weight", None), "quant_state", None)
            if qs is None:
                continue
            w = weights[name + ".weight"].float().reshape(-1, 64)
            codes, qs.state2.absmax, qs.offset = nested_absmax(w.abs().max(dim=1)[0],
                                                               qs.state2.code)
            differ += int((codes != qs.absmax).sum())
            qs.absmax = codes
        print(f"{what}: {differ} absmax codes of bitsandbytes' C library differ from its "
              f"reference algorithm's")
        return m

    shape = ["--seq-len", str(T), "--batch-size", str(B)]
    k = 3
    ok = True
    # The quantization alone: transformers' 4-bit model against `eval --qlora`.
    tk_eval = json.loads(run([tk, "eval", "--model", base_dir, "--qlora", "--data", tokens_bin,
                              "--tokenizer", "bytes", "--batch-size", str(B), "--seq-len",
                              str(T), "--batches", str(k), "--json", "--device", "cpu"]))
    for reference, tol in [(False, 1e-4), (True, 1e-6)]:
        model = quantized(reference).eval()
        with torch.no_grad():
            hf = np.mean([loss_of(model, *windows(tokens, i)).item() for i in range(k)])
        d = abs(hf - tk_eval["loss"])
        how = "its reference absmax codes" if reference else "as bitsandbytes quantizes"
        print(f"{what}: NF4 base ({how}), eval loss bitsandbytes {hf:.7f}, trainkit "
              f"{tk_eval['loss']:.7f}, diff {d:.2e}")
        ok &= d < tol
    # Training: trainkit's initial adapter (A drawn, B zero) over both NF4 bases.
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", targets]
    start = os.path.join(work, "qlora-start")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", base_dir, "--steps", "0", "--out", start, "--qlora"] + lora + shape)
    model = PeftModel.from_pretrained(quantized(True), start, is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ok &= len(trainable) == 2 * 2 * 7
    hf_losses = adapter_steps(model, trainable, tokens)
    trained = os.path.join(work, "qlora-trained")
    log = os.path.join(work, "log-qlora.jsonl")
    run([tk, "train", "--device", "cpu", "--data", tokens_bin, "--tokenizer", "bytes",
         "--init-from", base_dir, "--adapter", start, "--qlora", "--steps", str(STEPS),
         "--out", trained, "--lr", str(LR), "--lr-schedule", "constant", "--warmup-steps", "0",
         "--weight-decay", str(WD), "--grad-clip", str(CLIP), "--eval-every", "0",
         "--log-json", log] + shape)
    tk_losses = [json.loads(line)["loss"] for line in open(log)]
    for i, (a, b) in enumerate(zip(hf_losses, tk_losses)):
        print(f"{what}: step {i + 1} loss PEFT+bitsandbytes {a:.7f}, trainkit {b:.7f}, "
              f"diff {abs(a - b):.2e}")
        ok &= abs(a - b) < 1e-5
    ours = load_file(os.path.join(trained, "adapter_model.safetensors"))
    theirs = {k: v.detach().float().numpy()
              for k, v in get_peft_model_state_dict(model).items()}
    ok &= sorted(ours) == sorted(theirs)
    worst = max(float(np.abs(w - theirs[n]).max()) for n, w in ours.items())
    print(f"{what}: adapter after {STEPS} steps max |diff| {worst:.2e} over {len(ours)} tensors")
    ok &= worst < 2e-5
    return ok



CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def check_chat(tk, work, text_path):
    """`prepare --chat` against `apply_chat_template(..., return_assistant_tokens_mask)`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(text_path, encoding="utf-8") as f:
        text = f.read()[:20000]
    bpe.train_from_iterator([text], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    model_dir = os.path.join(work, "chat_model")
    tok.save_pretrained(model_dir)
    lines = text.split("\n")
    conversations = []
    for i in range(0, 60, 6):
        turns = [{"role": "system", "content": "Speak as in the play."}] if i % 12 == 0 else []
        for j, role in enumerate(["user", "assistant", "user", "assistant"]):
            turns.append({"role": role, "content": lines[i + j].strip() or "Ay."})
        conversations.append(turns)
    chat = os.path.join(work, "chat.jsonl")
    with open(chat, "w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
    out = os.path.join(work, "chat.bin")
    seq = 256
    run([tk, "prepare", "--chat", chat, "--tokenizer", model_dir, "--out", out, "--seq-len",
         str(seq), "--val-fraction", "0"])
    dtype = np.uint16
    ids = np.fromfile(out, dtype=dtype, offset=1024).astype(np.int64)
    flags = np.fromfile(out[:-4] + ".mask", dtype=np.uint8, offset=1024)
    ok, counted = True, 0
    for r, c in enumerate(conversations):
        hf = tok.apply_chat_template(c, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        want, mask = list(hf["input_ids"]), list(hf["assistant_masks"])
        assert len(want) <= seq, len(want)
        row = ids[r * seq:r * seq + len(want)].tolist()
        trained = (flags[r * seq:r * seq + len(want)] & 1).tolist()
        counted += sum(mask)
        if row != want or trained != mask:
            print(f"chat row {r}: ids equal {row == want}, trained positions equal "
                  f"{trained == mask} ({sum(trained)} against {sum(mask)})")
            ok = False
    ok &= counted > 0
    print(f"chat: {len(conversations)} conversations ({counted} assistant tokens), ids and "
          f"trained positions "
          f"{'equal' if ok else 'DIFFER'} to apply_chat_template's input_ids and "
          f"assistant_masks")
    return ok


def check_documents(tk, work):
    """Rows of several documents against each document alone (float64)."""
    from transformers import GPT2Config
    rng = np.random.default_rng(3)
    sep, seq, lengths = 0, 48, [[11, 30, 7], [20, 28]]
    docs = []
    for row in lengths:
        assert sum(row) == seq
        for n in row:
            docs.append(np.concatenate([rng.integers(1, 256, n - 1), [sep]]))
    stream = np.concatenate(docs + [np.array([sep])]).astype(np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(stream)]
    data = os.path.join(work, "documents.bin")
    with open(data, "wb") as f:
        f.write(header.tobytes())
        f.write(stream.tobytes())
    counted = sum(len(d) - 1 for d in docs)
    ok = True
    torch.manual_seed(1)
    models = [
        ("gpt2", GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256,
                                            n_positions=64, attn_implementation="eager"))),
        ("llama", LlamaForCausalLM(LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            attn_implementation="eager"))),
    ]
    for name, model in models:
        start = os.path.join(work, f"documents-{name}")
        model.float().save_pretrained(start)
        # Each document alone, in float64: the token-weighted mean of their losses.
        ref = model.double().eval()  # no dropout
        ref.zero_grad()
        total = 0
        for d in docs:
            ids = torch.tensor(d[None, :], dtype=torch.int64)
            logits = ref(ids).logits[0]
            total = total + F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
        loss = total / counted
        loss.backward()
        grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
        flags = ["--document-mask", "--separator-id", str(sep), "--batch-size",
                 str(len(lengths)), "--seq-len", str(seq), "--device", "cpu"]
        log = os.path.join(work, f"documents-{name}.jsonl")
        out = os.path.join(work, f"documents-{name}-trained")
        run([tk, "train", "--data", data, "--val-data", data, "--tokenizer", "bytes",
             "--init-from", start,
             "--steps", "1", "--optimizer", "sgd", "--lr", "1", "--lr-schedule", "constant",
             "--warmup-steps", "0", "--weight-decay", "0", "--grad-clip", "0",
             "--eval-every", "0", "--log-json", log, "--out", out] + flags)
        tk_loss = json.loads(open(log).readline())["loss"]
        tk_eval = json.loads(run([tk, "eval", "--model", start, "--data", data, "--tokenizer",
                                  "bytes", "--batches", "1", "--json"] + flags))
        before = load_file(os.path.join(start, "model.safetensors"))
        after = load_file(os.path.join(out, "model.safetensors"))
        worst, scale = 0.0, max(np.abs(g).max() for g in grads.values())
        for n, g in grads.items():
            if n not in after:
                continue  # a tied head: the embedding's gradient covers it
            got = before[n].astype(np.float64) - after[n].astype(np.float64)
            worst = max(worst, np.abs(got - g).max())
        d_loss = max(abs(tk_loss - loss.item()), abs(tk_eval["loss"] - loss.item()))
        good = d_loss < 1e-5 and worst < 1e-5 * max(scale, 1.0) and \
            tk_eval["trained_tokens"] == counted
        print(f"documents {name}: {len(docs)} documents in {len(lengths)} rows of {seq}; "
              f"loss trainkit {tk_loss:.7f} (eval {tk_eval['loss']:.7f}) against each "
              f"document alone {loss.item():.7f}; gradients max |diff| {worst:.2e} "
              f"(largest {scale:.2e}); {tk_eval['trained_tokens']} positions trained of "
              f"{len(stream) - 1}, as alone: {counted} {'OK' if good else 'MISMATCH'}")
        ok &= good
    return ok


if __name__ == "__main__":
    main()
