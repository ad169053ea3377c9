import torch, time, cute_kernels as ck
from cute_kernels.reference.attention import attention_ref
for d, causal in [(128, False), (128, True), (64, True), (256, False)]:
    q = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 250, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    t = time.time()
    out, lse = ck.flash_attn(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    ref, rlse = attention_ref(q, k, v, causal=causal)
    fin = torch.isfinite(rlse)
    print(d, causal, f"{time.time()-t:.1f}s", "err", (out.double()-ref).abs().max().item(),
          "lse err", (lse.double()-rlse)[fin].abs().max().item(), flush=True)
