"""Writes tests/data/nf4_bitsandbytes.safetensors: bitsandbytes' NF4 quantization (blocks of
64, double-quantized absmax in blocks of 256) of two bf16 matrices, and its
`dequantize_4bit` of them in f32 and bf16. `cargo test` (tests/nf4.rs) holds trainkit's
NF4 to these values.

Needs torch, bitsandbytes and safetensors:

    python tests/hf_parity/nf4_fixture.py
"""

import os

import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file


def nested_absmax(absmax, code):
    """bitsandbytes' default (torch) `quantize_blockwise` of `absmax - mean`, blocks of 256:
    the nearest code to each value over its block's absmax, the lower one on a midpoint.
    bitsandbytes' C CPU library, which `quantize_4bit` calls on the CPU, picked the
    neighbouring code for 3 of the 320 absmaxes here; trainkit quantizes as this reference
    does."""
    offset = absmax.mean()
    x = absmax - offset
    scales, qs = [], []
    for blk in x.split(256):
        m = blk.abs().max().clamp(min=1e-38)
        scaled = torch.clamp(blk * (1.0 / m), -1, 1)
        qs.append(torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8))
        scales.append(m)
    return torch.cat(qs), torch.stack(scales), offset


def quantized(name, a):
    q, st = F.quantize_4bit(a, blocksize=64, compress_statistics=True, quant_type="nf4")
    raw = F.quantize_4bit(a, blocksize=64, compress_statistics=False, quant_type="nf4")[1]
    qabs, scales, offset = nested_absmax(raw.absmax, st.state2.code)
    st.absmax, st.state2.absmax, st.offset = qabs, scales, offset
    st.dtype = torch.float32
    deq = F.dequantize_4bit(q, st)
    st.dtype = torch.bfloat16
    deq_bf16 = F.dequantize_4bit(q, st)
    return {
        f"{name}.input": a.contiguous(),
        f"{name}.codes": q.reshape(-1).contiguous(),
        f"{name}.absmax_codes": st.absmax.contiguous(),
        f"{name}.absmax_scales": st.state2.absmax.contiguous(),
        f"{name}.offset": st.offset.reshape(1).float().contiguous(),
        f"{name}.dequantized": deq.contiguous(),
        f"{name}.dequantized_bf16": deq_bf16.contiguous(),
    }


def main():
    torch.manual_seed(0)
    tensors = {"dynamic_code": F.create_dynamic_map(signed=True).contiguous()}
    # 320 blocks of 64: two blocks of double-quantized statistics, the second partial.
    a = torch.randn(160, 128) * 0.02
    a[3, 5] = 0.31  # an outlier that sets its block's absmax
    a[7, :64] = 0.0  # a block of zeros
    tensors.update(quantized("square", a.to(torch.bfloat16)))
    # 3,000 elements: a partial last block of 56.
    tensors.update(quantized("ragged", (torch.randn(3, 1000) * 0.05).to(torch.bfloat16)))
    out = os.path.join(os.path.dirname(__file__), "..", "data", "nf4_bitsandbytes.safetensors")
    save_file(tensors, out)
    print("wrote", os.path.normpath(out))


if __name__ == "__main__":
    main()
