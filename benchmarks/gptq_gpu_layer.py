"""One GLM-5-sized MoE layer through quantkit's GPTQ or SignRound from block-FP8, on a GPU: seconds and peak memory.

    python benchmarks/gptq_gpu_layer.py --work /tmp/glm5-layer --samples 256 --seq-len 2048 [--experts all|routed]
        [--algorithm gptq,signround] [--gpu-memory 70GiB] [--family deepseek_v3]

Builds a three-layer glm_moe_dsa checkpoint written as a block-FP8 release: layer 0 dense
(intermediate 12288), layers 1 and 2 MoE with 256 routed experts of width 2048 (top 8) and one shared
expert, hidden 6144; MLA + DSA attention at the sizes below. Random weights (timing does not depend
on their values), random calibration token ids. Then ``convert`` with glm5-int4-experts-gptq-g32 (or
glm5-int4-experts-signround-g32, at its own 200 steps) on ``cuda``, each recipe with its own ``experts`` unless
``--experts`` says otherwise, and the same checkpoint with the RTN recipe for reference. ``--family deepseek_v3``: a
DeepSeek-V3-sized layer instead (hidden 7168, 256 experts of width 2048, MLA). Prints a JSON line per calibrated
layer as it finishes and one JSON object per algorithm: per layer the seconds by phase, the peak GPU memory and the
expert groups, and the RTN time. Each output is deleted once measured (a GLM-5 layer's is 12 GB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
import yaml

GLM5_LAYER = dict(
    vocab_size=4096, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    n_group=1, topk_group=1, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, head_dim=64, index_topk=2048, index_head_dim=128,
    index_n_heads=32, max_position_embeddings=4096, num_nextn_predict_layers=0,
)


DEEPSEEK_V3_LAYER = dict(
    vocab_size=4096, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096,
    num_nextn_predict_layers=0,
)

# --small: the same layer shape in miniature, to try the script on a CPU
SMALL = dict(GLM5_LAYER, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8,
             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, head_dim=32, index_topk=16, index_head_dim=64,
             index_n_heads=4, vocab_size=512, max_position_embeddings=256)


def build(out: Path, device: str, dims: dict, family: str = "glm_moe_dsa") -> Path:
    """The checkpoint, its tensors drawn on ``device`` and FP8-encoded there (a CPU takes minutes for 10 G values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.checkpoint.reader import INDEX_NAME
    from quantkit.checkpoint.writer import write_safetensors
    from quantkit.examples.fp8_release import release_encoding
    from quantkit.formats.fp8_block import RELEASE_QUANTIZATION_CONFIG
    from quantkit.modeling import unfuse_experts

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(family, **dims)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = unfuse_experts({k: v for k, v in model.state_dict().items()})
    gen = torch.Generator(device=device).manual_seed(0)
    shard, size, files, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            write_safetensors(out / name, shard, {"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, meta in shapes.items():
        if meta.ndim == 1:
            t = 1 + 0.05 * torch.randn(meta.shape, generator=gen, device=device)
        else:
            t = torch.randn(meta.shape, generator=gen, device=device) * (1 / meta.shape[-1] ** 0.5)
        for k, v in release_encoding(name, t.to(torch.bfloat16)).items():
            shard[k] = v.cpu()
            size += v.numel() * v.element_size()
        if size > 4e9:
            flush()
    flush()
    data = config.to_dict() | {"quantization_config": dict(RELEASE_QUANTIZATION_CONFIG), "dtype": "bfloat16"}
    data.pop("torch_dtype", None)
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(data, indent=2))
    return out


def main() -> None:
    from quantkit.convert import convert
    from quantkit.packaged import recipes_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/glm5-layer"))
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--experts", choices=("all", "routed"), help="default: each recipe's own")
    parser.add_argument("--algorithm", default="gptq", help="gptq, signround, or both: gptq,signround")
    parser.add_argument("--family", default="glm_moe_dsa", choices=("glm_moe_dsa", "deepseek_v3"))
    parser.add_argument("--device", default="cuda", help="cuda, or a list cuda:0,cuda:1")
    parser.add_argument("--gpu-memory", help="the budget a layer may hold on each GPU (default: what is free)")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers: the first dense, the rest MoE (3: one "
                                                                "MoE layer with the forward to the next, one without)")
    parser.add_argument("--small", action="store_true", help="a miniature layer (try the script on a CPU)")
    parser.add_argument("--no-rtn", action="store_true", help="skip the RTN reference conversion")
    parser.add_argument("--compile", action="store_true",
                        help="SignRound's fake quantization compiled (the recipe's enable_torch_compile: true)")
    args = parser.parse_args()
    work = args.work
    dims = SMALL if args.small else GLM5_LAYER if args.family == "glm_moe_dsa" else DEEPSEEK_V3_LAYER
    if args.small and args.family == "deepseek_v3":
        dims = {k: v for k, v in SMALL.items() if not k.startswith("index_")}
    dims = dict(dims, num_hidden_layers=args.layers)
    prefix = {"glm_moe_dsa": "glm5", "deepseek_v3": "deepseek-v3"}[args.family]
    t0 = time.perf_counter()
    src = build(work / "src", args.device.split(",")[0], dims, args.family)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    data = work / "calibration.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(0, dims["vocab_size"], (args.seq_len,),
                                                                   generator=gen).tolist()}) + "\n"
                            for _ in range(args.samples)))
    for algorithm in args.algorithm.split(","):
        text = (recipes_dir() / f"{prefix}-int4-experts-{algorithm}-g32.yaml").read_text()
        head, _, rest = text.partition("quantkit_calibration:\n")
        own = yaml.safe_load(text)["quantkit_calibration"]
        experts = args.experts or own.get("experts", "all")
        if args.compile:
            rest = rest.replace("enable_torch_compile: false", "enable_torch_compile: true")
        recipe = work / f"recipe-{algorithm}.yaml"
        recipe.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {args.samples}\n"
                          f"  seq_len: {args.seq_len}\n  experts: {experts}\n" + rest[rest.index("quant_stage:"):])
        layers: list = []

        def on_layer(r, n, layers=layers, algorithm=algorithm):
            layers.append(r)
            print(json.dumps({"algorithm": algorithm, "layer": r.layer, "seconds": round(r.seconds, 1),
                              "peak_gib": round(r.peak_device_bytes / 2**30, 1), "groups": r.expert_groups,
                              "phases": {k: round(v, 1) for k, v in r.phases.items()}}), flush=True)

        dst = work / f"{algorithm}-{experts}"
        t0 = time.perf_counter()
        result = convert(src, dst, recipe, device=args.device, force=dst.exists(), on_layer=on_layer,
                         gpu_memory=args.gpu_memory)
        calibrated_s = time.perf_counter() - t0
        digest = hashlib.sha256()
        for shard in sorted(dst.glob("*.safetensors")):
            digest.update(shard.read_bytes())
        shutil.rmtree(dst)
        print(json.dumps({
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "family": args.family,
            "torch": torch.__version__, "samples": args.samples, "seq_len": args.seq_len, "experts": experts,
            "algorithm": algorithm, "tokens": args.samples * args.seq_len, "build_s": round(build_s, 1),
            "source_bytes": result.source_bytes, "gpu_memory": args.gpu_memory,
            "calibrated_convert_s": round(calibrated_s, 1), "compiled": args.compile,
            "shards_sha256": digest.hexdigest(),
            "layers": [{"layer": r.layer, "seconds": round(r.seconds, 1), "groups": r.expert_groups,
                        "phases": {k: round(v, 1) for k, v in r.phases.items()},
                        "peak_gib": round(r.peak_device_bytes / 2**30, 1), "weights": r.weights, "rtn": r.rtn}
                       for r in layers],
            "weights_by_method": result.calibrated["weights_by_method"],
        }), flush=True)
    if not args.no_rtn:
        t0 = time.perf_counter()
        convert(src, work / "rtn", f"{prefix}-int4-experts-g32", device=args.device, force=(work / "rtn").exists())
        print(json.dumps({"rtn_convert_s": round(time.perf_counter() - t0, 1)}))
        shutil.rmtree(work / "rtn")


if __name__ == "__main__":
    main()
