"""Small checkpoints (random weights) converted by quantkit, for tests/test_sglang_gpu.py:
``python benchmarks/sglang_gpu_models.py OUT`` writes OUT/mlp, OUT/all and OUT/mlp-kv (SmolLM2 architecture), and
OUT/deepseek_v3 and OUT/glm_moe_dsa (the real releases' layout with their MLA sizes, routed experts INT4 by the
experts recipes)."""
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.kv.calibrate import calibrate_kv

out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  rope_theta=100000.0, torch_dtype="bfloat16")
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
with torch.no_grad():
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.05)
src = out / "src"
model.save_pretrained(src)
convert(src, out / "mlp", "dense-mlp-w4a16-g32", device="cpu")
convert(src, out / "all", "dense-w4a16-g32", device="cpu")
shutil.copytree(out / "mlp", out / "mlp-kv")
calibrate_kv(out / "mlp-kv", in_place=True, batches=[torch.randint(0, 2048, (1, 64)) for _ in range(4)])
shutil.rmtree(src)
# the MLA sizes of DeepSeek-V3 and GLM-5 (the engines' MLA kernels are written for them), few heads and experts
mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=256)
for family, recipe in [("deepseek_v3", "deepseek-v3-int4-experts-g32"), ("glm_moe_dsa", "glm5-int4-experts-g32")]:
    src = build_synthetic(family, out / f"{family}-src", layers=3, experts=8, **mla)
    convert(src, out / family, recipe, device="cpu")
    shutil.rmtree(src)
for d in sorted(out.iterdir()):
    print(d.name, sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))
