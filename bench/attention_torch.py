#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention at the shapes bench_attention times, for comparison.

Backends FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION, chosen with
torch.nn.attention.sdpa_kernel; BF16 inputs from randn; CUDA events, warm-up, then the
median of 30 runs; the same FLOP count as bench/attention_bench.cu (forward
4*B*H*T*S*D, halved when causal; backward 2.5x the forward, forward+backward 3.5x).
Prints a table in the same form.

Usage: python3 bench/attention_torch.py [runs]
"""
import sys

import torch
from torch_timing import median_ms
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(4, 32, 4096, 128, True), (16, 12, 1024, 64, True)]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def bench(B, H, T, D, causal, name, backend, runs):
    # tessera's layout is [B, T, H, D]; SDPA takes [B, H, T, D]: a transposed view of it.
    q, k, v, d_out = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    with sdpa_kernel([backend]):
        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def bwd():
            torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)

        def both():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(o, (q, k, v), d_out)

        fwd_ms = median_ms(fwd, runs)
        bwd_ms = median_ms(bwd, runs)
        all_ms = median_ms(both, runs)
    flop = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    print(f"| B={B:<2} H={H:<2} T={T:<5} D={D:<3} {'causal' if causal else 'full':6} | {name:9} | "
          f"{fwd_ms:8.3f} | {flop / fwd_ms * 1e-9:7.1f} | {bwd_ms:8.3f} | {2.5 * flop / bwd_ms * 1e-9:7.1f} | "
          f"{all_ms:8.3f} | {3.5 * flop / all_ms * 1e-9:7.1f} |", flush=True)


def main():
    runs = max(20, int(sys.argv[1])) if len(sys.argv) > 1 else 30
    print(f"PyTorch {torch.__version__} SDPA, BF16, {torch.cuda.get_device_name()}, median of {runs} runs "
          "(TFLOP/s: causal counted as half)\n")
    print("| shape                            | backend   | fwd ms   | TFLOP/s | bwd ms   | TFLOP/s | f+b ms   | TFLOP/s |")
    print("|----------------------------------|-----------|----------|---------|----------|---------|----------|---------|")
    for shape in SHAPES:
        for name, backend in BACKENDS:
            try:
                bench(*shape, name, backend, runs)
            except RuntimeError as e:  # a backend that refuses the shape
                print(f"| {shape} | {name:9} | unavailable: {str(e).splitlines()[0][:80]} |", flush=True)


if __name__ == "__main__":
    main()
