"""Dense tensor-core GEMM for Hopper: TMA + wgmma, warp-specialized and persistent."""
