#!/usr/bin/env python3
"""MixtralForCausalLM logits of a Hugging Face model directory, in numpy.

    hf_mixtral_numpy.py MODEL_DIR TOKEN_IDS

An independent forward pass written from transformers' Mixtral modeling code (Llama
attention; the sparse MoE block: router "gate", softmax over the experts, top-k,
renormalised weights, experts.{e}.w2(silu(w1 x) * w3 x) summed with those weights), reading
the safetensors files with hf_reference_numpy's reader. Computes in float64 and prints
{"shape": [T, V], "logits": [...]} like hf_logits.py, for tests/test_hf_convert.cpp.
"""
import json
import os
import sys

import numpy as np

from hf_reference_numpy import causal_attention, read_weights, rms_norm, rotate_half, softmax


def moe_block(x, w, prefix, num_experts, top_k):
    probs = softmax(x @ w[prefix + "gate.weight"].T)  # [T, E]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        # Stable descending order: ties go to the lower expert, as torch.topk and tessera.
        chosen = sorted(range(num_experts), key=lambda e: (-probs[t, e], e))[:top_k]
        weights = probs[t, chosen] / probs[t, chosen].sum()
        for e, g in zip(chosen, weights):
            p = f"{prefix}experts.{e}."
            gate, up = x[t] @ w[p + "w1.weight"].T, x[t] @ w[p + "w3.weight"].T
            out[t] += g * ((gate / (1 + np.exp(-gate)) * up) @ w[p + "w2.weight"].T)
    return out


def mixtral_logits(cfg, w, ids):
    p = "model." if "model.embed_tokens.weight" in w else ""
    c, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    d = c // hq
    eps, theta = cfg.get("rms_norm_eps", 1e-5), cfg.get("rope_theta", 1e6)
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
        k, v = np.repeat(k, hq // hkv, axis=0), np.repeat(v, hq // hkv, axis=0)
        x = x + causal_attention(q, k, v) @ w[l + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[l + "post_attention_layernorm.weight"], eps)
        x = x + moe_block(m, w, l + "block_sparse_moe.", cfg["num_local_experts"], cfg["num_experts_per_tok"])
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
    logits = mixtral_logits(cfg, read_weights(model_dir), np.array(ids))
    json.dump({"shape": list(logits.shape), "logits": logits.flatten().tolist()}, sys.stdout)


if __name__ == "__main__":
    main()
