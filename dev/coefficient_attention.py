"""How fast is one decode token's attention on a layer's coefficient rows, and which way of writing it is fastest?

A SpillCache made with coefficients=True hands attention the decoder's rows R (x = R @ W) for the stored
tokens; PoC 17's RandomDecoder.attend_coefficients reads them. Two ways of writing it, side by side:
  v1  scores [S, heads] = R_k @ (W_k q), softmax over dim 0, p R_v as a split-K bmm over [S, heads]
      (what PoC 17 ran up to this script)
  v2  scores [heads, S] = (W_k q)^T @ R_k^T (tokens contiguous: softmax over the last dim), p R_v as a
      split-K bmm over [heads, S]
each checked against attention on the reconstructed K and V (torch SDPA, float32), then timed alone with
CUDA events (median of REPEATS) at 4K-64K stored tokens, and profiled (torch.profiler, kernel times) at the
largest context.

Command:  python3 dev/coefficient_attention.py            (an NVIDIA GPU; about 20 s)
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONTEXTS = [4096, 16384, 65536]  # stored tokens
HEADS, KV_HEADS, HEAD_DIM = 40, 8, 128  # PoC 17's 32B-class shape
WIDTH = 1032                            # coefficient row: K = 1024, two mean columns, padded to 8
RECENT = 16                             # rows of the recent window (plain K and V)
SPLIT = 1024                            # tokens per split-K slice
REPEATS = 20


def v1(q, rows_k, rows_v, w_k, w_v, recent_k, recent_v):
    kvh, d, groups = KV_HEADS, HEAD_DIM, HEADS // KV_HEADS
    qg = q.reshape(kvh, groups, d)
    wk, wv = w_k.shape[0], w_v.shape[0]
    q_coeff = torch.einsum("whd,hgd->whg", w_k.view(wk, kvh, d), qg).reshape(wk, HEADS)
    r = recent_k.shape[0]
    scores = torch.cat([rows_k @ q_coeff, torch.einsum("rhd,hgd->rhg", recent_k.view(r, kvh, d), qg).reshape(r, -1)])
    probs = torch.softmax(scores.float() * d ** -0.5, 0).to(rows_v.dtype)
    stored = rows_k.shape[0]
    whole = stored // SPLIT * SPLIT
    mixed = torch.zeros(HEADS, wv, dtype=torch.float32, device=q.device)
    if whole:
        p = probs[:whole].view(-1, SPLIT, HEADS).transpose(1, 2)
        mixed += torch.bmm(p, rows_v[:whole].view(-1, SPLIT, wv)).float().sum(0)
    if stored > whole:
        mixed += (probs[whole:stored].T @ rows_v[whole:]).float()
    out = torch.einsum("hgw,whd->hgd", mixed.to(w_v.dtype).view(kvh, groups, wv), w_v.view(wv, kvh, d))
    out = out + torch.einsum("rhg,rhd->hgd", probs[stored:].view(r, kvh, groups), recent_v.view(r, kvh, d))
    return out.reshape(1, HEADS * d)


def v2(q, rows_k, rows_v, w_k, w_v, recent_k, recent_v):
    kvh, d, groups = KV_HEADS, HEAD_DIM, HEADS // KV_HEADS
    qg = q.reshape(kvh, groups, d)
    wk, wv = w_k.shape[0], w_v.shape[0]
    stored, r = rows_k.shape[0], recent_k.shape[0]
    # the queries in the key basis, [heads, wk]: one small bmm per KV head
    q_coeff = torch.bmm(qg, w_k.view(wk, kvh, d).permute(1, 2, 0)).reshape(HEADS, wk)
    scores = torch.empty(HEADS, stored + r, dtype=torch.float32, device=q.device)
    scores[:, :stored] = q_coeff @ rows_k.T  # a transposed operand: no copy of R_k
    scores[:, stored:] = torch.bmm(qg, recent_k.view(r, kvh, d).permute(1, 2, 0)).reshape(HEADS, r)
    probs = torch.softmax(scores * d ** -0.5, -1).to(rows_v.dtype)  # tokens contiguous
    whole = stored // SPLIT * SPLIT
    mixed = torch.bmm(probs[:, :whole].view(HEADS, -1, SPLIT).transpose(0, 1),
                      rows_v[:whole].view(-1, SPLIT, wv)).float().sum(0) if whole else \
        torch.zeros(HEADS, wv, dtype=torch.float32, device=q.device)
    if stored > whole:
        mixed += (probs[:, whole:stored] @ rows_v[whole:]).float()
    out = torch.bmm(mixed.to(w_v.dtype).view(kvh, groups, wv), w_v.view(wv, kvh, d).transpose(0, 1))
    out = out + torch.bmm(probs[:, stored:].view(kvh, groups, r), recent_v.view(r, kvh, d).transpose(0, 1))
    return out.reshape(1, HEADS * d)


def reference(q, rows_k, rows_v, w_k, w_v, recent_k, recent_v):
    K = torch.cat([rows_k.float() @ w_k.float(), recent_k.float()])
    V = torch.cat([rows_v.float() @ w_v.float(), recent_v.float()])
    T = K.shape[0]
    K = K.view(T, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
    V = V.view(T, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q.float().view(1, HEADS, 1, HEAD_DIM), K, V, enable_gqa=True)
    return out[0, :, 0].reshape(1, HEADS * HEAD_DIM)


def inputs(S: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
    rows_k, rows_v = randn(S, WIDTH), randn(S, WIDTH)
    rows_k[:, 1024:1026] = 1  # the mean's columns
    rows_v[:, 1024:1026] = 1
    w_k, w_v = randn(WIDTH, KV_HEADS * HEAD_DIM, scale=0.05), randn(WIDTH, KV_HEADS * HEAD_DIM, scale=0.05)
    return randn(HEADS * HEAD_DIM), rows_k, rows_v, w_k, w_v, randn(RECENT, KV_HEADS * HEAD_DIM), \
        randn(RECENT, KV_HEADS * HEAD_DIM)


def ms(fn, args) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(REPEATS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    print(f"{torch.cuda.get_device_name()}; {HEADS} query heads, {KV_HEADS} KV heads of {HEAD_DIM}, rows {WIDTH} wide")
    for S in CONTEXTS:
        args = inputs(S)
        want = reference(*args)
        for name, fn in (("v1", v1), ("v2", v2)):
            got = fn(*args).float()
            err = float((got - want).abs().max() / want.abs().max())
            if err > 5e-2:  # bf16 probabilities and rows: v1 and v2 land at about 1e-2
                raise SystemExit(f"{name} at {S}: differs from attention on the reconstructed KV by {err:.3g} (relative)")
        print(f"S={S:>6}: v1 and v2 match attention on the reconstructed KV; v1 {ms(v1, args):.3f} ms, "
              f"v2 {ms(v2, args):.3f} ms (bytes of R_k + R_v: {2 * S * WIDTH * 2 / 1e6:.0f} MB)")
    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("v1", v1), ("v2", v2)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(*args)
            torch.cuda.synchronize()
        print(f"{name} at S={CONTEXTS[-1]}, kernels over 5 calls:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
