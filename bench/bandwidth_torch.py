#!/usr/bin/env python3
"""PyTorch's memory-bound ops at the shapes bench_bandwidth times, for comparison.

The same ops, shapes (16384 x 4096 and 16384 x 768, BF16), byte counts and table format as
bench/bandwidth_bench.cu: every tensor the op must read or write counted once, GB/s =
bytes / median time, and the fraction of the device-to-device copy (Tensor.copy_) measured
in the same run. CUDA events around one call, 5 warm-up calls, median of 30.

Eager runs the aten kernels directly where a backward has one (native_layer_norm_backward,
gelu_backward, _softmax_backward_data, ...), so the figures are the kernels' and not
autograd's bookkeeping; ops PyTorch has no single kernel for (the residual add before a
norm, SwiGLU, FP8 quantization) run as the eager composition a model would use.
torch.compile (default mode) is timed for the ops where it is cheap to compile: the norms'
and activations' forwards and backwards written as plain formulas.

Usage: python3 bench/bandwidth_torch.py [runs] [--no-compile]
"""
import sys

import torch
from torch_timing import median_ms
import torch.nn.functional as F

SHAPES = [(16384, 4096), (16384, 768)]
EPS = 1e-5


class Table:
    def __init__(self, rows, cols, runs):
        self.rows, self.cols, self.runs = rows, cols, runs
        self.copy_gbs = 0.0
        self.results = []

    def add(self, name, nbytes, ms):
        gbs = nbytes / (ms * 1e-3) * 1e-9
        if name == "copy_ (D2D)":
            self.copy_gbs = gbs
        self.results.append((name, nbytes, ms))
        pct = 100.0 * gbs / self.copy_gbs if self.copy_gbs else 0.0
        print(f"  {name:40s} {nbytes * 1e-6:9.1f} MB {ms * 1e3:9.1f} us {gbs:8.1f} GB/s {pct:6.1f}%", flush=True)

    def print(self):
        print(f"\n### PyTorch {torch.__version__}, {self.rows} x {self.cols} BF16 "
              f"(median of {self.runs} runs; % of the copy_ D2D figure)\n")
        print("| op | MB moved | us | GB/s | % of memcpy |\n| --- | ---: | ---: | ---: | ---: |")
        for name, nbytes, ms in self.results:
            gbs = nbytes / (ms * 1e-3) * 1e-9
            pct = 100.0 * gbs / self.copy_gbs if self.copy_gbs else 0.0
            print(f"| {name} | {nbytes * 1e-6:.1f} | {ms * 1e3:.1f} | {gbs:.0f} | {pct:.1f}% |")
        sys.stdout.flush()


def try_add(table, name, nbytes, fn, runs):
    """Times fn; an op this PyTorch lacks (or a compile that fails) is reported, not fatal."""
    try:
        table.add(name, nbytes, median_ms(fn, runs))
    except Exception as e:  # noqa: BLE001 - a missing op must not end the comparison
        print(f"  {name:40s} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)


# ---- Plain formulas for torch.compile (fused by Inductor into one or two kernels) ----

def ln_fwd(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def rms_fwd(x, w):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * rstd * w.float()).to(x.dtype), rstd


def rms_bwd(dy, x, w, rstd):
    xf, dyf = x.float(), dy.float()
    xhat = xf * rstd
    g = dyf * w.float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).sum(0)
    return dx.to(x.dtype), dw


def ln_bwd(dy, x, w, mean, rstd):
    xf, dyf = x.float(), dy.float()
    xhat = (xf - mean) * rstd
    g = dyf * w.float()
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0), dyf.sum(0)


def add_rms_fwd(x, r, w):
    s = x + r
    y, rstd = rms_fwd(s, w)
    return s, y, rstd


def gelu_fwd(x):
    return F.gelu(x, approximate="tanh")


def gelu_bwd(x, dy):
    xf = x.float()
    k = 0.7978845608028654
    inner = k * (xf + 0.044715 * xf * xf * xf)
    t = torch.tanh(inner)
    grad = 0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * k * (1 + 3 * 0.044715 * xf * xf)
    return (dy.float() * grad).to(x.dtype)


def swiglu_fwd(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_bwd(x, dy):
    g, u = x.float().chunk(2, dim=-1)
    d = dy.float()
    s = torch.sigmoid(g)
    dg = d * u * s * (1 + g * (1 - s))
    du = d * g * s
    return torch.cat([dg, du], dim=-1).to(x.dtype)


def bench_shape(R, C, runs, compile_too):
    dev, bf = "cuda", torch.bfloat16
    t = Table(R, C, runs)
    N = R * C
    A = 2 * N            # bytes of one BF16 activation
    stat = 4 * R         # one F32 per row
    print(f"\n== {R} x {C} BF16 ==", flush=True)
    x = torch.randn(R, C, device=dev, dtype=bf)
    r = torch.randn(R, C, device=dev, dtype=bf)
    dy = torch.randn(R, C, device=dev, dtype=bf)
    w = torch.randn(C, device=dev, dtype=bf) * 0.5
    b = torch.randn(C, device=dev, dtype=bf) * 0.5
    out = torch.empty_like(x)

    try_add(t, "copy_ (D2D)", 2 * A, lambda: out.copy_(x), runs)

    aten = torch.ops.aten
    # LayerNorm: native_layer_norm writes y, mean, rstd; the backward reads dy, x, w, mean, rstd.
    y, mean, rstd = aten.native_layer_norm(x, [C], w, b, EPS)
    ln_fwd_bytes = 2 * A + 2 * 2 * C + 2 * stat
    ln_bwd_bytes = 3 * A + 2 * C + 2 * stat + 2 * 2 * 2 * C  # dgamma/dbeta counted read + written, as tessera's
    try_add(t, "layernorm_forward", ln_fwd_bytes, lambda: aten.native_layer_norm(x, [C], w, b, EPS), runs)
    try_add(t, "layernorm_backward", ln_bwd_bytes,
            lambda: aten.native_layer_norm_backward(dy, x, [C], mean, rstd, w, b, [True, True, True]), runs)

    # RMSNorm: the fused kernel (aten._fused_rms_norm) when this PyTorch has it.
    rms_fwd_bytes = 2 * A + 2 * C + stat
    rms_bwd_bytes = 3 * A + 2 * C + stat + 2 * 4 * C
    if hasattr(aten, "_fused_rms_norm"):
        y_r, rstd_r = aten._fused_rms_norm(x, [C], w, EPS)
        try_add(t, "rmsnorm_forward (_fused_rms_norm)", rms_fwd_bytes, lambda: aten._fused_rms_norm(x, [C], w, EPS), runs)
        if hasattr(aten, "_fused_rms_norm_backward"):
            try_add(t, "rmsnorm_backward (_fused_rms_norm_backward)", rms_bwd_bytes,
                    lambda: aten._fused_rms_norm_backward(dy, x, [C], rstd_r, w, [True, True]), runs)
    try_add(t, "rmsnorm_forward (F.rms_norm)", rms_fwd_bytes, lambda: F.rms_norm(x, (C,), w, EPS), runs)

    # Residual add then norm, eager: two kernels forward; backward = the norm's + an add.
    add_ln_bytes = 4 * A + 2 * 2 * C + 2 * stat
    def add_ln():
        s = x + r
        return aten.native_layer_norm(s, [C], w, b, EPS)
    try_add(t, "add_layernorm_forward (add, layer_norm)", add_ln_bytes, add_ln, runs)
    def ln_bwd_add():
        dx, dw, db = aten.native_layer_norm_backward(dy, x, [C], mean, rstd, w, b, [True, True, True])
        return dx + r
    try_add(t, "layernorm_backward_add (bwd, add)", 4 * A + 2 * C + 2 * stat + 2 * 2 * 2 * C, ln_bwd_add, runs)
    if hasattr(aten, "_fused_rms_norm"):
        def add_rms():
            s = x + r
            return aten._fused_rms_norm(s, [C], w, EPS)
        try_add(t, "add_rmsnorm_forward (add, _fused_rms_norm)", 4 * A + 2 * C + stat, add_rms, runs)
        if hasattr(aten, "_fused_rms_norm_backward"):
            def rms_bwd_add():
                dx, dw = aten._fused_rms_norm_backward(dy, x, [C], rstd_r, w, [True, True])
                return dx + r
            try_add(t, "rmsnorm_backward_add (bwd, add)", 4 * A + 2 * C + stat + 2 * 4 * C, rms_bwd_add, runs)

    # Elementwise.
    try_add(t, "add(a, b)", 3 * A, lambda: torch.add(x, r, out=out), runs)
    try_add(t, "scale", 2 * A, lambda: torch.mul(x, 0.37, out=out), runs)
    try_add(t, "gelu_forward", 2 * A, lambda: F.gelu(x, approximate="tanh"), runs)
    try_add(t, "gelu_backward", 3 * A, lambda: aten.gelu_backward(dy, x, approximate="tanh"), runs)
    x2 = torch.randn(R, 2 * C, device=dev, dtype=bf)
    try_add(t, "swiglu_forward (silu(g) * u)", 3 * A, lambda: swiglu_fwd(x2), runs)
    x2g = x2.detach().requires_grad_(True)
    y2 = swiglu_fwd(x2g)
    try_add(t, "swiglu_backward (autograd)", 5 * A,
            lambda: torch.autograd.grad(y2, x2g, dy, retain_graph=True), runs)

    # Casts.
    xf = torch.randn(R, C, device=dev, dtype=torch.float32)
    try_add(t, "cast F32 -> BF16", 6 * N, lambda: xf.to(bf), runs)
    try_add(t, "cast BF16 -> F32", 6 * N, lambda: x.float(), runs)

    # Softmax.
    ys = torch.softmax(x, -1)
    try_add(t, "softmax_forward", 2 * A, lambda: torch.softmax(x, -1), runs)
    try_add(t, "softmax_backward", 3 * A, lambda: aten._softmax_backward_data(dy, ys, -1, bf), runs)

    # Cross-entropy over [R, C] logits (eager: log_softmax then nll_loss).
    targets = (torch.arange(R, device=dev, dtype=torch.int64) * 2654435761) % C
    xl = x.detach().requires_grad_(True)
    loss = F.cross_entropy(xl, targets)
    try_add(t, "cross_entropy_forward", A + 2 * stat + 4, lambda: F.cross_entropy(x, targets), runs)
    try_add(t, "cross_entropy_backward (autograd)", 2 * A + 2 * stat,
            lambda: torch.autograd.grad(loss, xl, retain_graph=True), runs)

    # FP8 per-tensor quantization (Transformer Engine style, eager): amax, then scale and cast.
    amax = x.abs().amax().float()
    scale = 448.0 / amax
    def quant():
        a = x.abs().amax()
        q = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, a
    try_add(t, "quantize_per_tensor BF16->E4M3 +amax", A + N + 8, quant, runs)
    try_add(t, "amax (BF16)", A + 4, lambda: torch.amax(x.abs()), runs)

    if compile_too:
        c_ln = torch.compile(ln_fwd)
        c_ln_bwd = torch.compile(ln_bwd)
        c_rms = torch.compile(rms_fwd)
        c_rms_bwd = torch.compile(rms_bwd)
        c_add_rms = torch.compile(add_rms_fwd)
        c_gelu, c_gelu_bwd = torch.compile(gelu_fwd), torch.compile(gelu_bwd)
        c_swiglu, c_swiglu_bwd = torch.compile(swiglu_fwd), torch.compile(swiglu_bwd)
        mean_k, rstd_k = mean.view(R, 1), rstd.view(R, 1)
        _, rstd_c = rms_fwd(x, w)
        try_add(t, "compile: layernorm_forward", ln_fwd_bytes, lambda: c_ln(x, w, b), runs)
        try_add(t, "compile: layernorm_backward", ln_bwd_bytes, lambda: c_ln_bwd(dy, x, w, mean_k, rstd_k), runs)
        try_add(t, "compile: rmsnorm_forward", rms_fwd_bytes, lambda: c_rms(x, w), runs)
        try_add(t, "compile: rmsnorm_backward", rms_bwd_bytes, lambda: c_rms_bwd(dy, x, w, rstd_c), runs)
        try_add(t, "compile: add_rmsnorm_forward", 4 * A + 2 * C + stat, lambda: c_add_rms(x, r, w), runs)
        try_add(t, "compile: gelu_forward", 2 * A, lambda: c_gelu(x), runs)
        try_add(t, "compile: gelu_backward", 3 * A, lambda: c_gelu_bwd(x, dy), runs)
        try_add(t, "compile: swiglu_forward", 3 * A, lambda: c_swiglu(x2), runs)
        try_add(t, "compile: swiglu_backward", 5 * A, lambda: c_swiglu_bwd(x2, dy), runs)
    t.print()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 30
    compile_too = "--no-compile" not in sys.argv
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for R, C in SHAPES:
        bench_shape(R, C, runs, compile_too)


if __name__ == "__main__":
    main()
