"""RMSNorm: the C++ kernel `csrc/rms_norm.cpp` for bf16 rows on CPU where it builds (one pass instead of torch's
~8 ops of a few microseconds each, 61 norms a SmolLM2 forward); torch's F.rms_norm otherwise (float32, autograd,
other devices, `SGLANG_DFLASH_KERNELS=torch`). Both round as torch does: bf16(x * rstd * w) from float32."""

import torch
import torch.nn.functional as F

from sglang_dflash.kernels.cpu_extensions import cpu_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalised over H and scaled by weight [H]."""
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and not x.requires_grad \
            and not weight.requires_grad and (kernel := cpu_kernel("rms_norm")) is not None:
        return kernel.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)
