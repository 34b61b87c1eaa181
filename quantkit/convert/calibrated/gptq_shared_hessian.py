"""llm-compressor's ``quantize_weight`` for a batch of weights that share one Hessian.

With ``experts: all`` every routed expert's gate and up projection of a layer share the Hessian of the layer's
calibration tokens (GLM-5: 512 weights, one 6144 x 6144 Hessian). ``quantize_weight`` takes one Hessian per weight,
so each batch of 64 carried 64 copies and dampened, ordered and Cholesky-factorized each of them: on one H200 most
of a layer's quantize phase. GPTQ treats every row of a weight independently given the Hessian's inverse factor,
so this does that work once per batch and runs llm-compressor's own block update (its Triton kernel on a GPU, its
eager loop elsewhere) on every weight against the one factor. Each step is ``quantize_weight``'s, in its order;
tests/test_gptq.py holds the result equal to it.
"""

from __future__ import annotations

import torch

from quantkit.convert.llmcompressor_import import quiet_llmcompressor


def quantize_sharing_hessian(weights: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor,
                             zero_point: torch.Tensor, quant_args, blocksize: int, percdamp: float):
    """``quantize_weight(weights, hessian.expand(B, -1, -1), scale, zero_point, None, ...)`` for weights [B, rows,
    columns] and one normalized Hessian [columns, columns] -> (quantized weights in the input dtype, losses [B],
    RTN-fallback flags [B])."""
    with quiet_llmcompressor("GPTQ recipes need llm-compressor"):
        from compressed_tensors.quantization import ActivationOrdering, QuantizationStrategy
        from llmcompressor.modifiers.gptq.gptq_quantize import gptq_block_update
        from llmcompressor.modifiers.gptq.helpers import GPTQ_PRECISION, apply_activation_ordering, factorize_hessian
    if quant_args.strategy not in (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL):
        raise ValueError(f"a shared Hessian is quantized for group and channel strategies, not {quant_args.strategy}")
    batch, rows, columns = weights.shape
    final_dtype, device = weights.dtype, weights.device
    W = weights.to(dtype=GPTQ_PRECISION)
    H = hessian.to(device=device, dtype=GPTQ_PRECISION).clone()[None]
    del weights

    # the permutation depends on the Hessian alone: found on it once, then applied to every weight
    _, H, perm = apply_activation_ordering(torch.empty((1, 1, columns), device=device), H, quant_args.actorder)
    if perm is not None:
        W = W[:, :, perm[0]]
    g_idx = None
    if quant_args.strategy == QuantizationStrategy.GROUP:
        g_idx = torch.arange(columns, device=device, dtype=torch.int) // quant_args.group_size
        if quant_args.actorder == ActivationOrdering.WEIGHT:
            assert perm is not None
            g_idx = torch.gather(g_idx.unsqueeze(0).expand(batch, -1), 1, perm.expand(batch, -1))

    # a dead column (zero on the diagonal) is zeroed in every weight, as factorize_hessian does to its batch
    dead = torch.diagonal(H, dim1=-2, dim2=-1) == 0
    if dead.any():
        W.masked_fill_(dead.unsqueeze(1), 0)
    fallback = torch.zeros(1, dtype=torch.bool, device=device)
    Hinv = factorize_hessian(torch.empty((1, 1, columns), device=device), H, percdamp, fallback)

    losses = torch.zeros(batch, rows, device=device)
    scale, zero_point = scale.to(device=device), zero_point.to(device=device)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1 = W[:, :, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        losses1 = torch.zeros_like(W1)
        gptq_block_update(W1, Hinv[:, i1:i2, i1:i2].expand(batch, -1, -1), Q1, Err1, losses1, scale=scale,
                          zero_point=zero_point, global_scale=None, g_idx=g_idx, quant_args=quant_args, i1=i1)
        W[:, :, i1:i2] = Q1
        losses += torch.sum(losses1, 2) / 2
        W[:, :, i2:] -= torch.matmul(Err1, Hinv[0, i1:i2, i2:])  # one GEMM for the batch: the factor is shared
    if perm is not None:
        W = torch.gather(W, -1, torch.argsort(perm, dim=-1).unsqueeze(-2).expand(batch, rows, -1))
    return W.to(final_dtype), losses.sum(dim=1), fallback.expand(batch)
