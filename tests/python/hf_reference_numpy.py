#!/usr/bin/env python3
"""GPT2LMHeadModel / LlamaForCausalLM logits of a Hugging Face model directory, in numpy.

    hf_reference_numpy.py MODEL_DIR TOKEN_IDS

An independent re-implementation of the two transformers models' forward passes, written
from their modeling code (Conv1D weights [in, out], q/k/v and gate/up projections,
rotate_half RoPE, repeat_kv grouping), that reads the safetensors files by hand. It lets
tests/test_hf_convert.cpp check the exported layout where torch is not installed. Computes
in float64; prints {"shape": [T, V], "logits": [...]} like hf_logits.py.
"""
import json
import os
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[base + begin:base + end]
        code = entry["dtype"]
        if code == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            values = bits.view(np.float32)
        else:
            values = np.frombuffer(raw, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[code])
        out[name] = values.astype(np.float64).reshape(entry["shape"])
    return out


def read_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    weights = {}
    for shard in shards:
        weights.update(read_safetensors(os.path.join(model_dir, shard)))
    return weights


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def causal_attention(q, k, v):
    """q [H, T, D], k and v [H, T, D] -> [T, H * D]."""
    t, d = q.shape[1], q.shape[2]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    return (softmax(scores) @ v).transpose(1, 0, 2).reshape(t, -1)


def layer_norm(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def gpt2_logits(cfg, w, ids):
    p = "transformer." if "transformer.wte.weight" in w else ""
    c, heads, eps = cfg["n_embd"], cfg["n_head"], cfg.get("layer_norm_epsilon", 1e-5)
    t = len(ids)
    x = w[p + "wte.weight"][ids] + w[p + "wpe.weight"][:t]
    for i in range(cfg["n_layer"]):
        h = f"{p}h.{i}."
        a = layer_norm(x, w[h + "ln_1.weight"], w[h + "ln_1.bias"], eps)
        qkv = a @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]  # Conv1D: x W + b
        q, k, v = (m.reshape(t, heads, c // heads).transpose(1, 0, 2) for m in np.split(qkv, 3, axis=-1))
        x = x + causal_attention(q, k, v) @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        m = layer_norm(x, w[h + "ln_2.weight"], w[h + "ln_2.bias"], eps)
        m = m @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"]
        m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
        x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    x = layer_norm(x, w[p + "ln_f.weight"], w[p + "ln_f.bias"], eps)
    tied = cfg.get("tie_word_embeddings", True)
    return x @ (w[p + "wte.weight"] if tied else w["lm_head.weight"]).T


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def llama_logits(cfg, w, ids):
    p = "model." if "model.embed_tokens.weight" in w else ""
    c, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    d = c // hq
    eps, theta = cfg.get("rms_norm_eps", 1e-6), cfg.get("rope_theta", 10000.0)
    t = len(ids)
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(np.arange(t), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    x = w[p + "embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        l = f"{p}layers.{i}."
        a = rms_norm(x, w[l + "input_layernorm.weight"], eps)
        q = (a @ w[l + "self_attn.q_proj.weight"].T).reshape(t, hq, d).transpose(1, 0, 2)
        k = (a @ w[l + "self_attn.k_proj.weight"].T).reshape(t, hkv, d).transpose(1, 0, 2)
        v = (a @ w[l + "self_attn.v_proj.weight"].T).reshape(t, hkv, d).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, hq // hkv, axis=0), np.repeat(v, hq // hkv, axis=0)  # repeat_kv
        x = x + causal_attention(q, k, v) @ w[l + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[l + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[l + "mlp.gate_proj.weight"].T, m @ w[l + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[l + "mlp.down_proj.weight"].T
    x = rms_norm(x, w[p + "norm.weight"], eps)
    tied = cfg.get("tie_word_embeddings", False)
    return x @ (w[p + "embed_tokens.weight"] if tied else w["lm_head.weight"]).T


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir = sys.argv[1]
    ids = [int(t) for t in sys.argv[2].split(",")]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    weights = read_weights(model_dir)
    forward = {"gpt2": gpt2_logits, "llama": llama_logits}[cfg["model_type"]]
    logits = forward(cfg, weights, np.array(ids))
    json.dump({"shape": list(logits.shape), "logits": logits.flatten().tolist()}, sys.stdout)


if __name__ == "__main__":
    main()
