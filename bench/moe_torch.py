#!/usr/bin/env python3
"""The Mixtral-shaped expert MLP in PyTorch, forward + backward, for comparison with bench_moe.

Same shape and splits as bench/moe_bench.cu: 8192 tokens top-2 over 8 experts (16384 expert
rows, expert-contiguous), hidden 4096, ffn 14336, BF16, the SwiGLU output scaled by the
routing probability. Two PyTorch forms:
  loop        one expert at a time (Hugging Face's MixtralSparseMoeBlock does this): three
              nn.Linear-style matmuls per expert;
  grouped_mm  torch._grouped_mm over all experts at once, with device-side offsets.
CUDA events, 3 warm-up calls, median of `runs`; the FLOP count of bench_moe. The gradients
accumulate from call to call (autograd adds into .grad), as in bench_moe's plain rows; the
"step" forms first set every .grad to None, so autograd writes them instead (a training step's
first micro-batch), as bench_moe's "step" rows do. The "4-micro step" forms time a whole
training step of four micro-batches (.grad set to None, then four forward + backward calls
accumulating) and report the time per micro-batch, as bench_moe's "4-micro step" rows do.

Usage: python3 bench/moe_torch.py [runs]
"""
import sys

import torch
import torch.nn.functional as F
from torch_timing import median_ms

TOKENS, TOPK, E, H, FFN = 8192, 2, 8, 4096, 14336
SPLITS = {"balanced": [TOKENS * TOPK // E] * E, "skewed": [4096, 3072, 2048, 2048, 1536, 1536, 1024, 1024]}


def make(splits):
    rows = sum(splits)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty(rows, H, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1, generator=g).requires_grad_(True)
    scale = torch.empty(rows, device="cuda", dtype=torch.bfloat16).uniform_(0.1, 0.9, generator=g)
    w_fc = torch.empty(E, 2 * FFN, H, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=g)
    w_proj = torch.empty(E, H, FFN, device="cuda", dtype=torch.bfloat16).uniform_(-0.01, 0.01, generator=g)
    dy = torch.empty(rows, H, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1, generator=g)
    return x, scale, w_fc.requires_grad_(True), w_proj.requires_grad_(True), dy


def swiglu(h, scale):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up * scale[:, None]


def loop_forward(x, scale, w_fc, w_proj, splits):
    outs, row = [], 0
    for e, n in enumerate(splits):
        xe = x[row:row + n]
        outs.append(swiglu(xe @ w_fc[e].t(), scale[row:row + n]) @ w_proj[e].t())
        row += n
    return torch.cat(outs)


def grouped_forward(x, scale, w_fc, w_proj, offsets):
    h = torch._grouped_mm(x, w_fc.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(swiglu(h, scale), w_proj.transpose(-2, -1), offs=offsets)


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    flop_fwd = 6.0 * TOKENS * TOPK * H * FFN
    print(f"PyTorch {torch.__version__} expert MLP on {torch.cuda.get_device_name()}: median of {runs} runs\n")
    print("| splits   | form            |  fwd ms | TFLOP/s | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|---|---|")
    for name, splits in SPLITS.items():
        x, scale, w_fc, w_proj, dy = make(splits)
        offsets = torch.tensor(splits, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        forms = {"loop": lambda: loop_forward(x, scale, w_fc, w_proj, splits),
                 "grouped_mm": lambda: grouped_forward(x, scale, w_fc, w_proj, offsets)}
        forms["loop step"] = forms["loop"]
        forms["grouped_mm step"] = forms["grouped_mm"]
        forms["loop 4-micro step"] = forms["loop"]
        forms["grouped_mm 4-micro step"] = forms["grouped_mm"]
        for form, fwd in forms.items():
            try:
                micro = 4 if "4-micro" in form else 1

                def forward_only():
                    with torch.no_grad():
                        fwd()

                def both():
                    if form.endswith("step"):
                        x.grad = w_fc.grad = w_proj.grad = None
                    for _ in range(micro):
                        y = fwd()
                        torch.autograd.backward(y, dy)

                fwd_ms = median_ms(forward_only, runs, 3)
                all_ms = median_ms(both, runs, 3) / micro
                print(f"| {name:8} | {form:23} | {fwd_ms:7.2f} | {flop_fwd / fwd_ms * 1e-9:7.1f} | {all_ms:10.2f} | "
                      f"{3 * flop_fwd / all_ms * 1e-9:7.1f} |", flush=True)
            except Exception as e:  # torch._grouped_mm is private and may be missing
                print(f"| {name:8} | {form:23} | failed: {type(e).__name__}: {e} |")
        x.grad = w_fc.grad = w_proj.grad = None


if __name__ == "__main__":
    sys.exit(main())
