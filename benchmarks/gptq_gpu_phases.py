"""GPTQ's Hessian and quantize phases on one GLM-5 MoE layer's experts (experts: all), on a GPU: llm-compressor's
primitives as quantkit called them before, beside quantkit's paths now; seconds and how far the results differ.

    python benchmarks/gptq_gpu_phases.py [--batches 8] [--weights 64]

Random bf16 weights and hidden states at GLM-5's sizes (256 experts, hidden 6144, expert width 2048, batches of
2048 tokens). Hessians: the layer's token Hessian and every expert's down-projection Hessian per batch, with
llm-compressor's accumulate_hessian (fp32 GEMMs) and with quantkit's tensor-core accumulation; the experts' own
GEMMs alone (the floor); seconds per batch and extrapolated to the recipe's 256 batches. Quantize: ``--weights``
gate/up projections sharing the token Hessian (one chunk of the layer's 512), with llm-compressor's quantize_weight
given a copy per weight (before) and quantize_sharing_hessian (now); and, for scale, quantize_weight on the same
weights in batches of 8 (its per-item Cholesky instead of its batched one), and on llm-compressor's Hessian of
the same tokens in calibration batches of two samples (its fp32 sums in another order) and on the exact Hessian
(fp64 sums, rounded to fp32 once). Differences: the share of
INT4 codes that differ and the relative change of GPTQ's loss.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def codes(fq: torch.Tensor, scale: torch.Tensor, gs: int) -> torch.Tensor:
    return fq.float().div(scale.float().repeat_interleave(gs, dim=-1)).round().to(torch.int8)


def main() -> None:
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    from quantkit.convert.calibrated.gptq import _accumulate_on_tensor_cores
    from quantkit.convert.calibrated.gptq_shared_hessian import quantize_sharing_hessian
    from quantkit.formats import int4
    from quantkit.formats.quant_config import QuantizationArgs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--weights", type=int, default=64)
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    E, hidden, width, tokens, gs = args.experts, 6144, 2048, 2048, 32
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * width, hidden, generator=gen, device=dev) / math.sqrt(hidden)).to(torch.bfloat16)
    xs = [torch.randn(tokens, hidden, generator=gen, device=dev).to(torch.bfloat16) for _ in range(args.batches)]
    linear = torch.nn.Linear(1, 1, device="meta")

    def down_inputs(x):
        for e in range(E):
            gate, up = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
            yield e, torch.nn.functional.silu(gate) * up

    def hessians(accumulate):
        sums = {k: torch.zeros((hidden, hidden) if k == "all" else (width, width), device=dev)
                for k in ["all", *range(E)]}
        counts = {k: torch.zeros((), device=dev) for k in sums}
        for x in xs:
            sums["all"], counts["all"] = accumulate(x, sums["all"], counts["all"])
            for e, a in down_inputs(x):
                sums[e], counts[e] = accumulate(a, sums[e], counts[e])
        return sums, counts

    def floor():
        for x in xs:
            for _ in down_inputs(x):
                pass

    _, floor_s = timed(floor)
    (ref, ref_n), ref_s = timed(lambda: hessians(lambda a, h, n: accumulate_hessian(a, linear, h, n)))
    (new, new_n), new_s = timed(lambda: hessians(_accumulate_on_tensor_cores))
    rel = max(float(torch.linalg.matrix_norm(new[k] - ref[k]) / torch.linalg.matrix_norm(ref[k])) for k in ref)
    assert all(torch.equal(ref_n[k], new_n[k]) for k in ref)
    per = 256 / args.batches
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batches": args.batches,
                 "hessians_s_per_256_batches": {"llm-compressor": round(ref_s * per, 1), "quantkit": round(new_s * per, 1),
                                                "experts_gemms_alone": round(floor_s * per, 1)},
                 "hessian_max_relative_difference": rel}

    # quantize: gate/up projections of one layer against the token Hessian, as run_gptq's chunks
    h_ref = ref["all"] / ref_n["all"]
    h_new = new["all"] / new_n["all"]
    # llm-compressor's own fp32 Hessian from calibration batches of two samples: the same sums in another order
    h_pairs, n_pairs = torch.zeros_like(h_ref), torch.zeros((), device=dev)
    for k in range(0, len(xs) - 1, 2):
        h_pairs, n_pairs = accumulate_hessian(torch.stack(xs[k:k + 2]), linear, h_pairs, n_pairs)
    h_pairs /= n_pairs
    # the exact sums (fp64 products and sums of the same bf16 values): how far each fp32 Hessian is from them
    h_exact = sum(2 * x.double().t() @ x.double() for x in xs) / len(xs)
    out["token_hessian_relative_error_vs_fp64"] = {
        name: float(torch.linalg.matrix_norm(h.double() - h_exact) / torch.linalg.matrix_norm(h_exact))
        for name, h in (("llm-compressor", h_ref), ("quantkit", h_new), ("llm-compressor_2-sample_batches", h_pairs))}
    h_exact = h_exact.float()
    del ref, new
    ws = (torch.randn(args.weights, width, hidden, generator=gen, device=dev) / math.sqrt(hidden)).to(torch.bfloat16)
    scale = torch.stack([int4.quantize_int4(w, gs)[1] for w in ws])
    zp = torch.zeros_like(scale, dtype=torch.int8)
    qargs = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=gs,
                             actorder="static").to_compressed_tensors()
    B = args.weights

    def before(h, n=B):
        parts = [quantize_weight(ws[k:k + n].float(), h.expand(len(ws[k:k + n]), -1, -1).clone(), scale[k:k + n],
                                 zp[k:k + n], None, qargs, blocksize=128, percdamp=0.01) for k in range(0, B, n)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def now(h):
        fq, losses, _ = quantize_sharing_hessian(ws.float(), h, scale, zp, qargs, blocksize=128, percdamp=0.01)
        return fq, losses

    (fq_b, loss_b), before_s = timed(lambda: before(h_ref))
    (fq_n, loss_n), now_s = timed(lambda: now(h_ref))
    (fq_8, loss_8), eights_s = timed(lambda: before(h_ref, 8))
    (fq_h, loss_h), _ = timed(lambda: now(h_new))
    (fq_p, loss_p), _ = timed(lambda: now(h_pairs))
    (fq_x, loss_x), _ = timed(lambda: now(h_exact))
    c_b = codes(fq_b, scale, gs)

    def differ(fq, loss):
        return {"codes_differing": float((codes(fq, scale, gs) != c_b).float().mean()),
                "loss_relative": float(((loss - loss_b).abs() / loss_b).max())}

    out["quantize"] = {
        "weights": B, "shape": [width, hidden],
        "seconds": {"llm-compressor, a Hessian per weight": round(before_s, 2),
                    "quantkit, one shared Hessian": round(now_s, 2),
                    "llm-compressor in batches of 8": round(eights_s, 2)},
        "per_layer_512_gate_up_s": {"llm-compressor": round(before_s * 512 / B, 1), "quantkit": round(now_s * 512 / B, 1)},
        "vs_llm-compressor_batched": {"quantkit_shared": differ(fq_n, loss_n),
                                      "llm-compressor_in_batches_of_8": differ(fq_8, loss_8),
                                      "quantkit_shared_and_tensor_core_hessian": differ(fq_h, loss_h),
                                      "quantkit_shared_and_llm-compressor_hessian_of_2-sample_batches":
                                          differ(fq_p, loss_p),
                                      "quantkit_shared_and_exact_hessian": differ(fq_x, loss_x)},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
