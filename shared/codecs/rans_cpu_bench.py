"""TensorCodec's CPU path (bf16 tensor -> bytes -> bf16 tensor) timed on `threads` cores, each way and
stage by stage, on the compiled coder of shared/codecs/rans_cpu.py (PoC 09 --api-cpu writes its rows):

    python -m shared.codecs.rans_cpu_bench [--threads 1] [--reps 9]

Kept apart from the coder: it drives the whole pipeline (shared.pipeline), which the coder must not import.
"""
from __future__ import annotations

import time

import numpy as np

from . import rans, rans_tables
from .rans_cpu import (L, _decode_lanes, _decode_tables, _encode_lanes, _encode_table, _histogram, _require, _tables,
                       decode, encode, parse)

# --------------------------------------------------------------------------------------------
# benchmark of TensorCodec's CPU path


def _timed(fn, reps: int):
    """(result, median wall seconds, median CPU seconds of the process) over reps calls after one
    untimed call. CPU time counts every thread (torch, BLAS and numba run one each here), so a
    busy machine's time-slicing does not count against the code."""
    out = fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return out, float(np.median(wall)), float(np.median(cpu))


def synthetic_cases(T: int = 4096, D: int = 1024, ks=(None, 256, 1024), target_cos: float = 0.999, seed: int = 0):
    """[(name, bf16 tensor [T, D], basis or None, step)]: a tensor with a decaying channel spectrum,
    its PCA basis of K components fitted on other draws of the same distribution (None: the raw
    channels), and the step that reaches target_cos on it (searched once, not timed)."""
    import torch

    from ..basis import as_float_matrix, fit_basis
    from ..rdquant import find_step

    rng = np.random.default_rng(seed)
    mix = (rng.standard_normal((D, D)) * (np.arange(1, D + 1) ** -1.2)[None, :]).astype(np.float32)

    def draw(n):
        return rng.standard_normal((n, D)).astype(np.float32) @ mix.T + 0.1

    x = torch.from_numpy(draw(T)).bfloat16()
    calib = fit_basis([draw(4096) for _ in range(2)], k=D)
    values = as_float_matrix(x)
    cases = []
    for k in ks:
        basis = None if k is None else calib.truncate(k)
        coeffs = values if basis is None else basis.project(values)
        step = find_step(coeffs, target_cos, "cos", reconstruct=(lambda c: c) if basis is None else basis.reconstruct,
                         reference=values).step
        cases.append((f"synthetic [{T}, {D}], " + ("no PCA" if k is None else f"PCA K={k}"), x, basis, step))
    return cases


def _gpu_formula(x, basis, step, symbols):
    """The GPU kernels' formulas (shared/_rdquant_triton.py) evaluated in float64 on the CPU, a
    proxy for what the GPU computes: (its symbols of x, its bf16 reconstruction of `symbols`)."""
    import torch

    comp = torch.from_numpy(basis.components).bfloat16().double()
    mean = torch.from_numpy(basis.mean).float()
    bias = (mean @ comp.float()).double()
    sym = torch.floor(((x.double() @ comp - bias).float() * np.float32(1.0 / step)).double() + 0.5).to(torch.int32)
    a = (torch.from_numpy(symbols).float() * np.float32(step)).bfloat16().double()
    return sym.numpy(), (a @ comp.T).float().add(mean).bfloat16()


def benchmark_cpu_pipeline(cases=None, threads: int = 1, reps: int = 9, check_reference: bool = True) -> list[dict]:
    """Time TensorCodec(basis, backend="rans", step=step) on each case's bf16 CPU tensor, each way,
    and each stage of it, on `threads` cores (torch, BLAS and numba limited to that many), beside a
    memcpy of the same bytes in the same run. Before timing: the round trip's cosine, the payload
    equal to the numpy reference coder's (check_reference; it takes seconds), and for a basis the
    agreement with the GPU kernels' formulas. Prints a table; returns one dict per measurement.

    cases: [(name, bf16 tensor, basis or None, step)], default synthetic_cases()."""
    import os

    import threadpoolctl
    import torch

    from ..container import unpack
    from ..pipeline import TensorCodec
    from ..rdquant import RDQuantizer, quality

    import numba

    _require()
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    rows = []
    with threadpoolctl.threadpool_limits(threads):
        for name, x, basis, step in (synthetic_cases() if cases is None else cases):
            T, D = x.shape
            nbytes = 2 * T * D
            load0 = os.getloadavg()[0]
            codec = TensorCodec(basis, backend="rans", step=step)
            blob = codec.encode(x)
            out = codec.decode(blob)
            cos = quality(x.float().numpy(), out.float().numpy(), "cos")
            header, chunks = unpack(blob)
            q = RDQuantizer(step)
            proj = codec._cpu_projection(x, "bfloat16")
            sym, stats = proj.quantize(x, q)
            payload = chunks["DATA"]
            checks = {"cos": cos, "ratio": nbytes / len(blob)}
            blob32 = codec.encode(x.float())  # the float32 path of the same values: float32 basis and GEMMs
            checks["cos_float32_path"] = quality(x.float().numpy(), codec.decode(blob32).numpy(), "cos")
            checks["ratio_float32_path"] = nbytes / len(blob32)
            if check_reference:
                checks["payload_equals_numpy_reference"] = float(rans.encode(sym) == payload)
                checks["decode_equals_numpy_reference"] = float(np.array_equal(rans.decode(payload), decode(payload)))
            if basis is not None:
                gsym, gout = _gpu_formula(x, basis, step, sym)
                checks["symbols_equal_gpu_formula"] = float((gsym == sym).mean())
                checks["decode_equals_gpu_formula"] = float((proj.reconstruct(sym, step) == gout).float().mean())
            print(f"\n{name}: {nbytes / 1e6:.1f} MB bf16 -> {len(blob)} bytes, " + ", ".join(
                f"{k} {v:.5g}" for k, v in checks.items()) + f"; {threads} thread(s), load average {load0:.2f}")
            if cos < 0.998 or checks.get("payload_equals_numpy_reference", 1.0) < 1 \
                    or checks.get("decode_equals_numpy_reference", 1.0) < 1:
                raise SystemExit(f"{name}: the round trip or the reference check failed ({checks})")
            src = x.view(torch.int16).numpy().view(np.uint8).reshape(-1)
            dst = np.empty_like(src)
            hdr = parse(payload)
            lay, n = hdr.layout, hdr.prob_bits
            tab = rans_tables.model_tables()
            lut = np.empty((hdr.K, 1 << n), np.uint8 if int(hdr.A.max()) <= 256 else np.uint16)
            mn, mx, sm = stats
            lo0, h0 = rans_tables.initial_windows(mn, mx, sm, T, n)
            stride, H = rans_tables.hist_row_stride(T), int(h0.max())
            counts, n_sampled = _histogram(sym, stride, lo0, h0, H, numba.get_num_threads())
            targs = (counts, h0, lo0, mn, mx, n_sampled, stride, n, tab["shapes"], tab["inv_sigma"], tab["sigma16_sq"],
                     rans_tables._neg_log2_table(n), rans_tables.ESCAPE_COST, rans_tables.TABLE_ENTRY_COST, rans_tables.PARAM_BYTES,
                     rans_tables.MODEL_MIN_SHARE, rans_tables.MODEL_SEARCH)
            lo, W, esc, _, _, _, _, freq, cum, _ = _tables(*targs)
            fc_enc = _encode_table(freq, cum)
            fc, lut, _ = _decode_tables(np.asarray(hdr.codes_flat), hdr.model, hdr.scale, hdr.mu16, hdr.W, hdr.esc, n,
                                        tab["shapes"], tab["inv_sigma"], lut)
            mv = memoryview(payload)
            states = np.full(lay.n_lanes, L, np.uint32)
            states[np.tile(hdr.A > 1, lay.P)] = np.frombuffer(mv[lay.states:lay.streams], "<u4")
            words = np.frombuffer(mv[lay.streams:lay.total], "<u2")
            y = x if basis is None else x @ proj.components
            ybits = y.view(torch.int16).numpy().view(np.uint16)
            ybias = None if basis is None else proj.bias
            coef = torch.from_numpy(np.empty((T, proj.K + 1), np.uint16).view(np.int16)).view(torch.bfloat16)
            stages = [
                ("encode", "api", lambda: codec.encode(x)),
                ("encode", "projection: bf16 GEMM x @ C", None if basis is None else (lambda: x @ proj.components)),
                ("encode", "quantize + column statistics", lambda: q.quantize_with_stats(ybits, ybias, bf16=True)),
                ("encode", "rANS: histogram", lambda: _histogram(sym, stride, lo0, h0, H, numba.get_num_threads())),
                ("encode", "rANS: tables", lambda: _tables(*targs)),
                ("encode", "rANS: coding pass", lambda: _encode_lanes(sym, lo, W, *fc_enc, hdr.S, hdr.G, lay.n_groups,
                                                                      n, False)),
                ("encode", "rANS: whole payload", lambda: encode(sym, stats=stats)),
                ("decode", "api", lambda: codec.decode(blob)),
                ("decode", "container: parse, CRC32", lambda: unpack(blob)),
                ("decode", "rANS: parse, checksum", lambda: parse(payload)),
                ("decode", "rANS: tables", lambda: _decode_tables(np.asarray(hdr.codes_flat), hdr.model, hdr.scale,
                                                                  hdr.mu16, hdr.W, hdr.esc, n, tab["shapes"],
                                                                  tab["inv_sigma"], lut)),
                ("decode", "rANS: decoding pass", lambda: _decode_lanes(words, hdr.group_words, states,
                                                                        np.asarray(hdr.escapes), hdr.group_escapes, fc,
                                                                        lut, hdr.lo, hdr.W, hdr.esc, hdr.T, hdr.K,
                                                                        hdr.S, hdr.G, n, False)),
                ("decode", "rANS: whole payload", lambda: decode(payload)),
                ("decode", "reconstruct: dequantize to bf16" + ("" if basis is None else ", GEMM + mean")
                 + ", finite check", lambda: proj.reconstruct(sym, step)),
                ("decode", "of which bf16 GEMM + mean", None if basis is None else
                 (lambda: torch.addmm(proj.mean_hi, coef, proj.weight.t()))),
                ("reference", "memcpy of the bf16 bytes", lambda: np.copyto(dst, src)),
            ]
            common = dict(case=name, tokens=T, channels=D, k=D if basis is None else basis.k, threads=threads,
                          repeats=reps, tensor_mb=nbytes / 1e6, step=step)
            print(f"  {'':44s} {'CPU ms':>8s} {'wall ms':>8s} {'GB/s (CPU time)':>16s}")
            times = {}
            for direction, stage, fn in stages:
                if fn is None:
                    continue
                _, wall, cpu = _timed(fn, reps)
                times[(direction, stage)] = cpu
                print(f"  {direction + ': ' + stage:44s} {1e3 * cpu:8.2f} {1e3 * wall:8.2f} {nbytes / cpu / 1e9:16.3f}")
                rows.append(dict(common, direction=direction, stage=stage, metric="cpu_ms", value=1e3 * cpu, unit="ms"))
                rows.append(dict(common, direction=direction, stage=stage, metric="wall_ms", value=1e3 * wall,
                                 unit="ms"))
                rows.append(dict(common, direction=direction, stage=stage, metric="gbps", value=nbytes / cpu / 1e9,
                                 unit="GB/s of bf16 per CPU second"))
            t_enc, t_dec = times[("encode", "api")], times[("decode", "api")]
            saved = nbytes * (1 - len(blob) / nbytes)
            crossover = saved / (t_enc + t_dec) / 1e9  # GB/s of link below which encode + send + decode wins
            print(f"  codec beats sending raw bf16 (one after the other, no overlap) on links below {crossover:.3f} "
                  f"GB/s ({8 * crossover:.2f} Gbit/s); load average at the end {os.getloadavg()[0]:.2f}")
            for metric, value in checks.items():
                rows.append(dict(common, direction="both", stage="check", metric=metric, value=value,
                                 unit="x vs bf16" if metric.startswith("ratio") else
                                 ("cos" if metric.startswith("cos") else "fraction")))
            rows.append(dict(common, direction="both", stage="api", metric="crossover_link_gbps", value=crossover,
                             unit="GB/s"))
            rows.append(dict(common, direction="both", stage="machine", metric="load_average", value=load0,
                             unit="runnable tasks (1 min)"))
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="time TensorCodec's CPU path (compiled rANS coder), stage by stage")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    benchmark_cpu_pipeline(threads=args.threads, reps=args.reps)
