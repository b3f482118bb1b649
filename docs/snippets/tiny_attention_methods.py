"""Per-token perplexity inside (0-128) and past (128-512) the tiny trained model's window, for the
training-free methods at factor 4: python docs/snippets/tiny_attention_methods.py (about a minute on one CPU thread)."""

import math, torch, torch.nn.functional as F
import rope_ext
from transformers import AutoTokenizer, LlamaForCausalLM
from rope_ext.training.tiny import ensure_tiny, heldout_ids

torch.set_num_threads(1)
path = ensure_tiny()
ids = heldout_ids(AutoTokenizer.from_pretrained(path))
W, L = 128, 512
rows = torch.stack([ids[s : s + L + 1] for s in range(0, 16 * (L + 1), L + 1)])  # 16 consecutive held-out passages
for method in ("plain", "ntk", "yarn", "self_extend", "dca", "sink_window"):
    model = LlamaForCausalLM.from_pretrained(path).eval()
    if method != "plain":
        rope_ext.patch(model, method, factor=4)
    with torch.no_grad():
        nll = torch.cat([F.cross_entropy(model(r[None, :-1]).logits[0], r[1:], reduction="none") for r in rows.unbind()]).view(
            16, L
        )
    print(f"| {method} | {math.exp(nll[:, :W].mean()):.2f} | {math.exp(nll[:, W:].mean()):.2f} |")
