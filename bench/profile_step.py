#!/usr/bin/env python3
"""Where the GPU time of one tessera training step goes, kernel by kernel.

Runs bench_train_step twice: once plainly (the wall-clock step time), once under Nsight
Compute with profiling limited to the last step (`--profile`), reading one metric per
kernel, gpu__time_duration. Kernels are then grouped by what they do (GEMM, attention,
norms, ...) and printed as milliseconds per step and share of the step. The difference
between the wall-clock step and the sum of kernel times is time the GPU sat idle
(launch gaps, host work, synchronisation).

  python3 bench/profile_step.py --build build-gpu --model gpt2-124m --vocab 50304 --batch 16 --seq 1024
  python3 bench/profile_step.py --build build-gpu --model llama3.2-1b --batch 4 --seq 2048

Needs a GPU and `ncu` (CUDA toolkit). ncu serialises kernels, so the kernel times are each
kernel alone on the GPU, the figure that matters for a step that runs one stream.
"""
import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

# First match wins: the order puts specific patterns before broad ones.
CATEGORIES = [
    ("attention (cuDNN)", r"cudnn|sdpa|fmha|flash"),
    ("attention backward", r"attention.*(backward|bwd|dq|dkdv|delta)"),
    ("attention forward", r"attention"),
    ("GEMM", r"gemm|nvjet|sm90_xmma|cutlass|cublas|splitk|matmul"),
    ("norm (+ residual add)", r"norm"),
    ("cross-entropy", r"cross_entropy|loss|logsumexp"),
    ("embedding", r"embedding"),
    ("rope", r"rope"),
    ("activation", r"gelu|swiglu|silu"),
    ("optimizer (AdamW, grad norm)", r"adamw|grad_norm|multi_tensor|l2norm|clip"),
    ("FP8 cast / amax", r"quantize|amax|fp8|cast"),
    ("copy / fill", r"copy|memset|fill|strided|transpose"),
]


def category(name):
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def short(name, width=90):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu", help="build directory holding bench_train_step")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--top", type=int, default=15, help="how many individual kernels to list")
    ap.add_argument("--json", help="also write the grouped figures to this file")
    args, bench_args = ap.parse_known_args()
    if not bench_args:
        bench_args = ["--model", "gpt2-124m", "--vocab", "50304", "--batch", "16", "--seq", "1024"]
    bench = [f"{args.build}/bench_train_step", "--device", "cuda", "--precision", "bf16", *bench_args]

    plain = subprocess.run([*bench, "--steps", "10", "--warmup", "3"], capture_output=True, text=True)
    if plain.returncode != 0:
        sys.exit(f"profile_step: bench_train_step failed:\n{plain.stderr}")
    wall = json.loads(plain.stdout.strip().splitlines()[-1])
    step_ms = wall["median_step_s"] * 1e3

    # Auto's attention choice is timed, and under ncu (which replays and serialises every
    # kernel) the timing can come out the other way: a profile of a step that ran cuDNN showed
    # tessera's kernels and their packing copies instead. The profiled run is told what the
    # plain run chose ("tessera: attention ... -> cudnn (...)" on stderr).
    choices = set(re.findall(r"tessera: attention .* -> (cudnn|tessera)", plain.stderr))
    env = dict(os.environ)
    if len(choices) == 1 and "TESSERA_ATTENTION_BACKEND" not in env:
        env["TESSERA_ATTENTION_BACKEND"] = choices.pop()
        print(f"attention backend as the plain run chose it: {env['TESSERA_ATTENTION_BACKEND']}")
    elif len(choices) > 1:
        print("note: the plain run chose different attention backends per shape; the profiled run decides again")
    profiled = subprocess.run(
        [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", "gpu__time_duration.sum",
         "--csv", "--print-units", "base", *bench, "--steps", "1", "--warmup", "2", "--profile"],
        capture_output=True, text=True, env=env)
    if profiled.returncode != 0:
        sys.exit(f"profile_step: ncu failed (exit {profiled.returncode}):\n{profiled.stderr[-3000:]}")
    # ncu prints its own log lines (==PROF==) before the CSV; the CSV starts at the header.
    text = profiled.stdout
    start = text.find('"ID"')
    if start < 0:
        sys.exit(f"profile_step: no kernel rows in ncu's output:\n{text[-3000:]}")
    per_kernel = defaultdict(lambda: [0.0, 0])
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(row["Metric Value"].replace(",", ""))
        entry = per_kernel[row["Kernel Name"]]
        entry[0] += ns / 1e6
        entry[1] += 1

    groups = defaultdict(lambda: [0.0, 0])
    for name, (ms, count) in per_kernel.items():
        g = groups[category(name)]
        g[0] += ms
        g[1] += count
    kernel_ms = sum(ms for ms, _ in groups.values())
    launches = sum(count for _, count in groups.values())

    print(f"model args: {' '.join(bench_args)}")
    print(f"wall-clock step (median of 10): {step_ms:.2f} ms, {wall['tokens_per_s']:.0f} tokens/s, MFU {wall['mfu']:.3f}")
    print(f"kernel time of one step: {kernel_ms:.2f} ms in {launches} launches; "
          f"GPU idle {step_ms - kernel_ms:.2f} ms ({100 * (step_ms - kernel_ms) / step_ms:.1f}% of the step)")
    print()
    print(f"{'what':32s} {'ms/step':>9s} {'share':>7s} {'launches':>9s}")
    for label, (ms, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{label:32s} {ms:9.2f} {100 * ms / step_ms:6.1f}% {count:9d}")
    print(f"{'idle (wall - kernels)':32s} {step_ms - kernel_ms:9.2f} {100 * (step_ms - kernel_ms) / step_ms:6.1f}%")
    print("(ncu runs each kernel alone, at the clocks an idle GPU boosts to: under a step's sustained load the same")
    print(" kernels can run slower, which shows up here as idle time)")
    print()
    print("largest kernels of each group:")
    for label, _ in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        members = sorted(((ms, count, name) for name, (ms, count) in per_kernel.items() if category(name) == label),
                         reverse=True)
        print(f"  {label}:")
        for ms, count, name in members[:3]:
            print(f"    {ms:8.2f} ms {count:5d}x  {short(name)}")
    print()
    print(f"top {args.top} kernels:")
    for name, (ms, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {ms:8.2f} ms {count:5d}x  {short(name)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": bench_args, "step_ms": step_ms, "kernel_ms": kernel_ms,
                       "groups": {k: v[0] for k, v in groups.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
