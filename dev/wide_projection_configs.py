"""Which tile shape runs project_quantize_wide_kernel fastest, beside cuBLAS's bare GEMM of the same shape?
Kernel-only (triton.testing.do_bench, median), on a 64 MB bf16 tensor per width.

    python3 dev/wide_projection_configs.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from shared import _rdquant_triton as kt  # noqa: E402
from shared.codecs.rans_cuda import floats_on  # noqa: E402
from shared.rdquant import CudaProjection  # noqa: E402

CANDIDATES = [  # BM, BN, BD, warps, stages, GROUP_M
    (128, 128, 64, 8, 3, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (256, 128, 64, 8, 3, 8),
    (128, 64, 64, 4, 4, 8), (128, 128, 128, 8, 3, 8), (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8), (64, 256, 64, 4, 4, 8), (128, 256, 64, 8, 3, 16), (256, 128, 64, 8, 3, 4),
    (128, 256, 128, 8, 3, 8), (256, 256, 64, 8, 3, 8),
]


def main():
    print(torch.cuda.get_device_name())
    for D in (1024, 4096):
        T = (64 << 20) // (2 * D)
        x = torch.randn(T, D, device="cuda").bfloat16()
        comps = torch.linalg.qr(torch.randn(D, D, device="cuda"))[0]
        proj = CudaProjection(torch.zeros(D), comps.cpu())
        flops = 2 * T * D * D
        ms = triton.testing.do_bench(lambda: x @ proj.components, return_mode="median")
        print(f"D={D}: cuBLAS x @ basis (bf16 out, no quantizer) {ms * 1e3:7.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")
        ref = None
        for bm, bn, bd, w, st, gm in CANDIDATES:
            sym = torch.empty((1, T, D), dtype=torch.int16, device="cuda")
            mn = torch.full((1, D), 2**31 - 1, dtype=torch.int32, device="cuda")
            mx = torch.full((1, D), -2**31, dtype=torch.int32, device="cuda")
            sm = torch.zeros((1, D), dtype=torch.int64, device="cuda")
            amax = torch.zeros(1, dtype=torch.float32, device="cuda")
            inv = floats_on([100.0], "cuda")
            grid = (-(-T // bm) * -(-D // bn), 1)

            def call():
                kt.project_quantize_wide_kernel[grid](x, proj.components, proj.bias, sym, mn, mx, sm, amax, T, D, D,
                                                      inv, T.bit_length(), BM=bm, BN=bn, BD=bd, UPCAST=False,
                                                      GROUP_M=gm, SUM32=True, num_warps=w, num_stages=st)
            try:
                call()
                torch.cuda.synchronize()
                if ref is None:
                    ref = sym.clone()
                same = torch.equal(sym, ref)
                ms = triton.testing.do_bench(call, return_mode="median")
                print(f"  BM={bm:3d} BN={bn:3d} BD={bd:3d} warps={w} stages={st} group={gm:2d}: {ms * 1e3:7.1f} us "
                      f"{flops / ms / 1e9:6.0f} TFLOP/s  symbols {'match' if same else 'DIFFER'}")
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported and skipped
                print(f"  BM={bm} BN={bn} BD={bd} warps={w} stages={st}: failed ({type(e).__name__}: {str(e)[:80]})")


if __name__ == "__main__":
    main()
