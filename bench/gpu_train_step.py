#!/usr/bin/env python3
"""tessera vs PyTorch on one GPU: a training step of the same model, side by side in one run.

Models (random tokens, BF16 compute, FP32 master weights, AdamW):
  gpt2   GPT-2 124M, B=16 T=1024. PyTorch: a nanoGPT-style model (SDPA attention, tied
         embeddings, BF16 autocast, fused AdamW), eager and optionally torch.compile.
  gpt2-v50304  the same with the vocabulary padded to 50304 (a multiple of 64), as nanoGPT
         and llm.c train it: every implementation's LM head GEMMs get aligned shapes.
  mixtral2  two layers of Mixtral-8x7B (8 experts top-2), B=4 T=2048. PyTorch: Hugging Face
         MixtralForCausalLM (router aux loss on); MFU over the active parameters.
  llama  Llama-3.2-1B-shaped (1.24B parameters), B=4 T=2048. PyTorch: Hugging Face
         LlamaForCausalLM (SDPA attention), BF16 autocast, fused AdamW.

Timing: warm-up steps, then the median wall time of `--steps` steps, each ending with a
CUDA synchronize (tessera's step ends with the loss on the host anyway). MFU is against
989 TFLOP/s with PaLM's FLOP count (6 N + 12 L C T per token). The same optimizer work in
every implementation: no gradient clipping (tessera's --grad-clip 0), or with --clip global-
norm clipping to 1.0 in all (torch.nn.utils.clip_grad_norm_, foreach). Peak memory is
torch.cuda.max_memory_reserved for PyTorch and the caching allocator's highwater mark
for tessera (both: memory the process held).

    python3 bench/gpu_train_step.py --build build-gpu [--models gpt2,llama] [--compile] [--fp8 delayed]

With --fp8 RECIPE, tessera also runs with the blocks' linear layers in FP8 (the rows' last
column is then tessera BF16 against each row, so an FP8 speed-up shows as a ratio below 1);
with --cast-in-optimizer and --fp8 delayed, mixtral2 also runs with fp8.cast_in_optimizer.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PEAK = 989e12


def flops_per_token(params, layers, hidden, seq):
    return 6.0 * params + 12.0 * layers * hidden * seq


def time_steps(step, warmup, steps):
    import torch

    times = []
    for s in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpt2_torch(batch, seq, compile_model, v=50257):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    c, layers, h = 768, 12, 12

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.fc, self.fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v_ = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v_ = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v_))
            y = F.scaled_dot_product_attention(q, k, v_, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(v, c), nn.Embedding(1024, c)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(c)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, v), targets.view(-1))  # autocast runs it in FP32

    model = GPT().cuda()
    params = sum(p.numel() for p in model.parameters())
    return model, params, layers, c, v


def HfLoss(model):
    """A Hugging Face causal LM as a module (idx, targets) -> loss, the form the step times."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, idx, targets):
            return self.m(input_ids=idx, labels=targets).loss

    return Wrap(model)


def llama_torch(batch, seq, compile_model):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).cuda()
    params = sum(p.numel() for p in model.parameters())

    return HfLoss(model), params, 16, 2048, 128256


# 2 layers of Mixtral-8x7B (8 experts top-2, hidden 4096, ffn 14336 per expert, GQA 32/8).
MIXTRAL2 = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=2, num_heads=32,
                num_kv_heads=8, max_seq_len=2048, rope_theta=1e6, num_experts=8, num_experts_per_tok=2)


def mixtral2_torch(batch, seq, compile_model):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    m = MIXTRAL2
    cfg = MixtralConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                        intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                        max_position_embeddings=m["max_seq_len"], rope_theta=m["rope_theta"],
                        num_local_experts=m["num_experts"], num_experts_per_tok=m["num_experts_per_tok"],
                        tie_word_embeddings=False, router_aux_loss_coef=0.01, output_router_logits=True)
    cfg._attn_implementation = "sdpa"
    model = MixtralForCausalLM(cfg).cuda()

    return HfLoss(model), active_params(model), m["num_layers"], m["hidden_size"], m["vocab_size"]


def active_params(model):
    """Parameters a token passes through (top-2 of 8 experts): what MFU counts for an MoE."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    k, e = MIXTRAL2["num_experts_per_tok"], MIXTRAL2["num_experts"]
    return total - expert + expert * k // e


def run_torch(name, batch, seq, compile_model, warmup, steps, clip=False):
    import torch

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    if name == "llama":
        model, params, layers, hidden, vocab = llama_torch(batch, seq, compile_model)
    elif name == "mixtral2":
        model, params, layers, hidden, vocab = mixtral2_torch(batch, seq, compile_model)
    else:
        model, params, layers, hidden, vocab = gpt2_torch(batch, seq, compile_model, VOCAB[name])
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, vocab, (batch, seq), device="cuda")
    tgt = torch.randint(0, vocab, (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    median = time_steps(step, warmup + (3 if compile_model else 0), steps)
    tps = batch * seq / median
    out = {"impl": f"pytorch {torch.__version__} {'compile' if compile_model else 'eager'}" + (" clip" if clip else ""),
           "params": params,
           "median_step_s": median, "tokens_per_s": tps,
           "mfu": tps * flops_per_token(params, layers, hidden, seq) / PEAK,
           "peak_memory_gib": torch.cuda.max_memory_reserved() / 2**30}
    del model, opt
    torch.cuda.empty_cache()
    return out


VOCAB = {"gpt2": 50257, "gpt2-v50304": 50304, "llama": 128256, "mixtral2": MIXTRAL2["vocab_size"]}


def run_tessera(build, name, batch, seq, warmup, steps, fp8=None, clip=False, autotune=False, loss_fusion=None,
                overlap=False, keep_layers=0, cast_in_optimizer=False):
    model = "llama3.2-1b" if name == "llama" else "gpt2-124m"
    if name == "mixtral2":
        model = json.dumps(dict(MIXTRAL2, architecture="mixtral", tie_embeddings=False,
                                router_aux_loss_coef=0.01))
    cmd = [os.path.join(build, "bench_train_step"), "--model", model, "--device", "cuda", "--precision", "bf16",
           "--batch", str(batch), "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup),
           "--vocab", str(VOCAB[name]), "--grad-clip", "1.0" if clip else "0"]
    if fp8:
        cmd += ["--fp8", fp8]
    if cast_in_optimizer:
        cmd += ["--fp8-cast-in-optimizer"]
    if autotune:
        cmd += ["--gemm-autotune"]
    if overlap:
        cmd += ["--optimizer-overlap"]
    if keep_layers:
        cmd += ["--keep-activation-layers", str(keep_layers)]
    env = None
    if loss_fusion:
        env = dict(os.environ, TESSERA_CROSS_ENTROPY_FUSED="1" if loss_fusion == "on" else "0")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    result["impl"] = ((f"tessera fp8 ({fp8} scaling)" if fp8 else "tessera bf16") + (" clip" if clip else "") +
                      (" cast in optimizer" if cast_in_optimizer else "") +
                      (" gemm-autotune" if autotune else "") + (f" loss fusion {loss_fusion}" if loss_fusion else "") +
                      (" optimizer overlap" if overlap else "") + (f" keep h in {keep_layers}" if keep_layers else ""))
    if name == "mixtral2":  # MFU over the active parameters, as for PyTorch's figure
        m, p = MIXTRAL2, result["params"]
        expert = 3 * m["num_layers"] * m["num_experts"] * m["hidden_size"] * m["intermediate_size"]
        active = p - expert + expert * m["num_experts_per_tok"] // m["num_experts"]
        result["mfu"] = result["tokens_per_s"] * flops_per_token(active, m["num_layers"], m["hidden_size"], seq) / PEAK
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--models", default="gpt2,gpt2-v50304,llama")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile")
    ap.add_argument("--fp8", action="append", default=[], choices=["current", "delayed"],
                    help="also time tessera with the blocks' linears in FP8 under this recipe (repeatable)")
    ap.add_argument("--clip", action="store_true",
                    help="clip gradients to global norm 1.0 in every implementation (default: none, in all)")
    ap.add_argument("--gemm-autotune", action="store_true",
                    help="also time tessera BF16 with its GEMM algorithms autotuned (training.gemm_autotune)")
    ap.add_argument("--loss-fusion", choices=["on", "off"],
                    help="also time tessera BF16 with the LM head's loss and gradient in one pass over the logits "
                         "(on) or two (off): TESSERA_CROSS_ENTROPY_FUSED=1 or 0")
    ap.add_argument("--optimizer-overlap", action="store_true",
                    help="also time tessera BF16 with the AdamW update overlapped with the backward "
                         "(optimizer.overlap_backward; not with --clip)")
    ap.add_argument("--keep-activation-layers", type=int, action="append", default=[], metavar="N",
                    help="llama: also time tessera BF16 with the last N layers keeping the SwiGLU output "
                         "(model.keep_activation_layers; repeatable; with --loss-fusion these runs use it too)")
    ap.add_argument("--cast-in-optimizer", action="store_true",
                    help="with --fp8 delayed: also time tessera with the MoE experts' FP8 casts made by the "
                         "optimizer's update (fp8.cast_in_optimizer)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    shapes = {"gpt2": (16, 1024), "gpt2-v50304": (16, 1024), "llama": (4, 2048), "mixtral2": (4, 2048)}
    rows = []
    for name in args.models.split(","):
        batch, seq = shapes[name]
        results = [run_tessera(args.build, name, batch, seq, args.warmup, args.steps, clip=args.clip)]
        if args.gemm_autotune:
            results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, clip=args.clip,
                                       autotune=True))
        if args.loss_fusion:
            results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, clip=args.clip,
                                       loss_fusion=args.loss_fusion))
        if args.optimizer_overlap and not args.clip:
            results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, overlap=True))
        for keep in args.keep_activation_layers:
            results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, clip=args.clip,
                                       loss_fusion=args.loss_fusion, keep_layers=keep))
        for recipe in args.fp8:
            results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, fp8=recipe, clip=args.clip))
            if args.cast_in_optimizer and recipe == "delayed" and name == "mixtral2":
                results.append(run_tessera(args.build, name, batch, seq, args.warmup, args.steps, fp8=recipe,
                                           clip=args.clip, cast_in_optimizer=True))
        results.append(run_torch(name, batch, seq, False, args.warmup, args.steps, clip=args.clip))
        if args.compile:
            results.append(run_torch(name, batch, seq, True, args.warmup, args.steps, clip=args.clip))
        for r in results:
            r.update(model=name, batch=batch, seq=seq)
            print(json.dumps(r), flush=True)
        rows.append(results)
    print(f"\n{'model':12} {'implementation':32} {'tok/s':>10} {'MFU':>6} {'peak GiB':>9} {'tessera/this':>12}")
    for results in rows:
        ours = results[0]["tokens_per_s"]
        for r in results:
            print(f"{r['model']:12} {r['impl']:32} {r['tokens_per_s']:10.0f} {r['mfu']:6.3f} "
                  f"{r.get('peak_memory_gib', 0):9.1f} {ours / r['tokens_per_s']:12.2f}")


if __name__ == "__main__":
    sys.exit(main())
