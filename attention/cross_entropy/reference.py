"""Reference: losses and logit gradients in float32. Correct within the Princeton problem's
tolerances: atol 1e-3, rtol 1e-2."""

import torch

from task import input_t, output_t

ATOL, RTOL = 1e-3, 1e-2


def generate_input(batch, vocab, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (batch,), device="cuda", generator=g)
    grad = torch.rand(batch, device="cuda", generator=g)
    return logits, targets, grad


def ref_kernel(data: input_t) -> output_t:
    logits, targets, grad = data
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    losses = lse - x.gather(1, targets[:, None])[:, 0]
    dlogits = torch.softmax(x, dim=-1)
    dlogits[torch.arange(x.shape[0], device=x.device), targets] -= 1
    return losses, (dlogits * grad[:, None]).to(torch.bfloat16)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        return False, "expected a tuple (losses, dlogits)"
    for name, got, ref in zip(("losses", "dlogits"), output, expected):
        if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
            return False, f"{name}: expected {tuple(ref.shape)} {ref.dtype}"
        diff = (got.float() - ref.float()).abs()
        if not (diff <= ATOL + RTOL * ref.float().abs()).all():
            return False, f"{name}: max error {diff.max().item():.3e}"
    return True, ""
