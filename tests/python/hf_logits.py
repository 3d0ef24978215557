#!/usr/bin/env python3
"""Logits of a Hugging Face model directory computed by transformers, as JSON on stdout.

    hf_logits.py MODEL_DIR TOKEN_IDS

TOKEN_IDS is one comma-separated sequence, e.g. 3,1,4,1,5. Prints
{"shape": [T, V], "logits": [...]} (row-major, float32 values). Used by
tests/test_hf_convert.cpp to check tessera's Hugging Face export against transformers.
"""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_dir = sys.argv[1]
    ids = [int(t) for t in sys.argv[2].split(",")]
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    dtype_arg = "dtype" if version >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", **{dtype_arg: torch.float32})
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], dtype=torch.long)).logits[0].float()
    json.dump({"shape": list(logits.shape), "logits": logits.flatten().tolist()}, sys.stdout)


if __name__ == "__main__":
    main()
