#!/usr/bin/env python3
"""tessera vs PyTorch: one CPU training step of the same GPT-2-shaped model, side by side.

Runs build/bench_train_step and an equivalent PyTorch model (LayerNorm, causal attention,
GELU-tanh MLP, tied embeddings, AdamW) on random tokens with the same thread count, and
prints both medians and the ratio. Usage:
    python3 bench/cpu_train_step.py [--build build] [--layers 6 --hidden 384 --heads 6 --batch 8 --seq 256]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time


def torch_step_time(args, threads):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.fc, self.fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # PyTorch 1.x (Debian bookworm's python3-torch): the same attention, unfused
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
                mask = torch.ones(t, t, dtype=torch.bool).triu(1)
                y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            y = y.transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, v, c, layers, h, t):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(v, c), nn.Embedding(t, c)
            self.blocks = nn.ModuleList(Block(c, h) for _ in range(layers))
            self.ln_f = nn.LayerNorm(c)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    for p in model.parameters():  # GPT-2's init, as tessera's, so both start near ln V
        if p.dim() >= 2:
            nn.init.normal_(p, 0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    times = []
    for s in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        if s >= args.warmup:
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return {"impl": f"pytorch {torch.__version__} eager", "params": params,
            "median_step_s": statistics.median(times), "min_step_s": min(times),
            "tokens_per_s": args.batch * args.seq / statistics.median(times), "loss": loss.item()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    model = {"architecture": "gpt2", "vocab_size": args.vocab, "hidden_size": args.hidden, "num_layers": args.layers,
             "num_heads": args.heads, "max_seq_len": args.seq, "tie_embeddings": True}
    cmd = [os.path.join(args.build, "bench_train_step"), "--model", json.dumps(model), "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    ours = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
    try:
        theirs = torch_step_time(args, threads)
    except ImportError:
        print("PyTorch is not installed: cannot run the baseline", file=sys.stderr)
        print(json.dumps(ours))
        return 1
    print(json.dumps(ours))
    print(json.dumps(theirs))
    assert ours["params"] == theirs["params"], "the two models differ in size"
    print(f"threads {threads}: tessera {ours['tokens_per_s']:.0f} tok/s, {theirs['impl']} {theirs['tokens_per_s']:.0f} tok/s, "
          f"ratio {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x (initial loss ln V = {math.log(args.vocab):.2f}: "
          f"{ours['loss']:.2f} vs {theirs['loss']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
