"""Every Triton kernel of the compute codec compiles for an NVIDIA H200 (sm_90) on a machine
without a GPU.

The other CPU tests run the kernels under Triton's interpreter, which executes them as Python and
so accepts code that Triton's compiler refuses (a `tl.constexpr` assigned twice in a static loop ran
interpreted and failed to compile on the GPU). Here a small interpreted encode and decode records
every launch (kernel, argument types, constants, warps, stages); each is then compiled down to a
cubin for sm_90 (its 16-byte-aligned arguments marked as Triton's launcher marks them), with the
GPU's own choices where the interpreter's differ (bf16 tensor-core products,
the warp vote, the stream prefetch, one lane group a program) and with every tile the projection's
autotuner tries on a GPU. No variant may take more than COMPILE_SECONDS_MAX to compile, as a
user's first call waits for each kernel it launches.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton, torch"], capture_output=True).returncode == 0

RECORD = """
import inspect, json, sys
sys.path[:0] = ["tests", "."]
import numpy as np, torch
import triton.language as tl
from test_rans import enable_interpreter
enable_interpreter()
from triton.runtime.interpreter import InterpretedFunction

POINTERS = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
            torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
            torch.bool: "*i1"}
launches = {}
interpret = InterpretedFunction.run

def recorded(self, *args, grid, warmup, **kwargs):
    params = list(inspect.signature(self.fn).parameters.values())
    given = dict(zip([p.name for p in params], args), **kwargs)
    types, consts, aligned = {}, {}, []
    for p in params:
        if p.name not in given:
            continue  # a constant left at its default
        v = given[p.name]
        if p.annotation is tl.constexpr:
            consts[p.name] = {"dtype": v.name} if isinstance(v, tl.dtype) else (v.item() if hasattr(v, "item") else v)
        elif isinstance(v, torch.Tensor):
            types[p.name] = POINTERS[v.dtype]
            if v.data_ptr() % 16 == 0:
                aligned.append(p.name)
        elif isinstance(v, (bool, np.bool_)):
            types[p.name] = "i1"
        elif isinstance(v, (int, np.integer)):
            types[p.name] = "i32" if -2**31 <= int(v) < 2**31 else "i64"
            if int(v) % 16 == 0:
                aligned.append(p.name)
        else:
            types[p.name] = "fp32"
    launch = dict(module=self.fn.__module__, name=self.fn.__name__, types=types, consts=consts, aligned=aligned,
                  num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))
    launches[json.dumps(launch, sort_keys=True)] = launch
    return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

InterpretedFunction.run = recorded

from shared.codecs import rans, rans_cuda
from shared.rdquant import CudaProjection

rng = np.random.default_rng(0)
x = (rng.standard_normal((96, 24)) @ rng.standard_normal((24, 24))).astype(np.float32)
mean = x.mean(0)
comps = np.linalg.svd(x - mean, full_matrices=False)[2].T[:, :16].copy()
proj = CudaProjection(mean, comps, device="cpu")
xt = torch.from_numpy(x).to(torch.bfloat16)
sym, (mn, mx, sm), amax = proj.quantize_many(xt.unsqueeze(0), [0.05], narrow=True)
xh = xt.half()
proj.quantize_many(xh.unsqueeze(0), [0.05], addresses=torch.tensor([xh.data_ptr()]))
x72 = (rng.standard_normal((96, 72)) @ rng.standard_normal((72, 72))).astype(np.float32)
wide = CudaProjection(x72.mean(0), np.linalg.svd(x72 - x72.mean(0), full_matrices=False)[2].T[:, :16].copy(),
                      device="cpu")
wide.BLOCK = dict(proj.BLOCK, BD=16)  # D > 3 BD: the wide tensors' kernel
x72t = torch.from_numpy(x72).to(torch.bfloat16)
wide.quantize_many(x72t.unsqueeze(0), [0.05], narrow=True)
h72 = x72t.half()
wide.quantize_many(h72.unsqueeze(0), [0.05], addresses=torch.tensor([h72.data_ptr()]))
proj.reconstruct_many(sym, [0.05])
# float32 inputs read by address, through the kernel that hoists its basis (D <= 3 BD, as on a GPU)
x32 = torch.from_numpy(x)
hoisted = CudaProjection(mean, comps, device="cpu")
hoisted.BLOCK = dict(proj.BLOCK, BD=64)
hoisted.quantize_many(x32.unsqueeze(0), [0.05], addresses=torch.tensor([x32.data_ptr()]))
blobs = rans_cuda.encode_many_cuda([sym[0], sym[0].int()], lane_tokens=32, stats=[(mn[0], mx[0], sm[0])] * 2)
rans_cuda.decode_many_cuda(list(blobs))
rans_cuda.decode_many_cuda(list(blobs), scales=[(0.05, 1e30, proj.coefficient_width(), 16)] * 2)
# lanes by component: encoded, and decoded COMPONENT_TILE components a program (whole groups of 32 blocks)
tall = torch.from_numpy(rng.integers(-20, 20, (512, 16)).astype(np.int32))
tall_blobs = rans_cuda.encode_many_cuda([tall], lane_tokens=8, lanes_by_component=True)
rans_cuda.decode_many_cuda(list(tall_blobs))
rans_cuda.decode_many_cuda(list(tall_blobs), scales=[(0.05, 1e30, proj.coefficient_width(), 16)])
payload = bytes(blobs[0].numpy())
front = bytes(range(16))
box = front[:-8] + len(payload).to_bytes(8, "little") + payload + bytes(4)
dec = rans_cuda.SlotDecoder([front], [payload], rans.read_header(payload), (2 * len(box) + 64) // 16 * 16, "cpu")
dec.set_sources([torch.frombuffer(bytearray(box), dtype=torch.uint8)])
dec.launch()
json.dump(list(launches.values()), open(sys.argv[1], "w"))
"""

COMPILE = """
import importlib, json, sys, time
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shared import _rdquant_triton
from shared.codecs import rans_cuda

DTYPES = {d.name: d for d in (tl.bfloat16, tl.float16, tl.float32)}
H200 = GPUTarget("cuda", 90, 32)
# seconds one variant may take to compile here: a user's first call waits for every kernel it launches
# (on a 2-core CPU machine the codec's kernels take 0.1-3 s each; a histogram whose 64 sampled rows
# were unrolled took 61-79 s, and a GPU test run ran out of time compiling its specializations)
COMPILE_SECONDS_MAX = 20
SHARED_MAX = 232448  # bytes of shared memory a block may use on an H100 or H200 (sm_90)


def on_the_gpu(launch):
    \"\"\"The launch as a GPU makes it: bf16 products, and the lanes kernels' settings from rans_cuda's
    own rules, which this process (not interpreting) answers as on a GPU.\"\"\"
    c = dict(launch["consts"])
    out = dict(launch, consts=c)
    if "UPCAST" in c:
        c["UPCAST"] = False
    if "PREFETCH" in c:
        c["PREFETCH"] = rans_cuda.USE_STREAM_PREFETCH and rans_cuda._ptx()
    if c.get("TILE"):  # by-component decode: the same tile of components a program as on a GPU
        c["GPP"] = rans_cuda.COMPONENT_TILE
        out["num_warps"] = rans_cuda._warps(c["G"], rans_cuda.COMPONENT_TILE)
    elif "GPP" in c:
        c["GPP"] = rans_cuda._groups_per_program()
        out["num_warps"] = rans_cuda._warps(c["G"])
    if "VOTE" in c:
        c["VOTE"] = rans_cuda._vote(c["G"])
    return out


def variants(launch):
    \"\"\"(variant, tuned): the launch as a GPU makes it, then every tile the autotuner tries (tuned).\"\"\"
    yield on_the_gpu(launch), False
    if launch["name"] in ("project_quantize_kernel", "project_quantize_wide_kernel"):  # every tile autotuned
        configs = _rdquant_triton._PROJECT_CONFIGS if launch["name"] == "project_quantize_kernel" \
            else _rdquant_triton._WIDE_CONFIGS
        for cfg in configs:
            c = dict(launch["consts"], **cfg.kwargs, UPCAST=False)
            yield dict(launch, consts=c, num_warps=cfg.num_warps, num_stages=cfg.num_stages), True
    if launch["name"] == "reconstruct_kernel":
        for cfg in _rdquant_triton._RECON_CONFIGS:
            yield dict(launch, consts=dict(launch["consts"], **cfg.kwargs, UPCAST=False), num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages), True


failed, done, slowest = [], 0, (0.0, "")
for launch in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    fitting = []  # per autotuned tile: does its shared memory fit the GPU (the autotuner skips those that don't)
    for v, tuned in variants(launch):
        consts = {k: DTYPES[x["dtype"]] if isinstance(x, dict) else x for k, x in v["consts"].items()}
        signature = {name: "constexpr" if name in consts else v["types"].get(name) for name in fn.arg_names
                     if name in consts or name in v["types"]}
        # arguments a GPU launch would find 16-byte aligned (pointers) or divisible by 16 (ints), as
        # Triton's launcher specializes them, so the loads vectorize as they do on the GPU
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in v["aligned"] if n not in consts}
        try:
            start = time.perf_counter()
            kernel = triton.compile(ASTSource(fn, signature, constexprs=consts, attrs=attrs), target=H200,
                                    options=dict(num_warps=v["num_warps"], num_stages=v["num_stages"]))
            slowest = max(slowest, (time.perf_counter() - start, launch["name"]))
            done += 1
            if tuned:
                fitting.append(kernel.metadata.shared <= SHARED_MAX)
        except Exception as e:
            failed.append(f"{launch['name']} {v['consts']}: {str(e)[-600:]}\\n  cause: {repr(e.__cause__)[-500:]}")
    if fitting and not any(fitting):
        failed.append(f"{launch['name']} {launch['types']} {launch['consts']}: no autotuned tile fits in "
                      f"{SHARED_MAX} bytes of shared memory")
print(f"compiled {done} kernel variants for sm_90; slowest {slowest[1]} {slowest[0]:.1f} s")
if slowest[0] > COMPILE_SECONDS_MAX:
    failed.append(f"{slowest[1]} took {slowest[0]:.0f} s to compile (limit {COMPILE_SECONDS_MAX} s): a user's first call waits for it")
for f in failed:
    print("FAILED", f)
sys.exit(1 if failed else 0)
"""


def _run(code: str, env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **env))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton and torch")
def test_every_kernel_compiles_for_the_h200(tmp_path):
    launches = tmp_path / "launches.json"
    r = _run(RECORD, dict(TRITON_INTERPRET="1"), str(launches))
    assert r.returncode == 0, f"recording the interpreted launches failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    names = {launch["name"] for launch in json.loads(launches.read_text())}
    # the encoder's and the decoder's kernels, the projection and its inverse, the slot decoder's staging
    assert {"project_quantize_kernel", "project_quantize_wide_kernel", "reconstruct_kernel", "hist_kernel", "tables_kernel", "encode_kernel",
            "decode_meta_kernel", "decode_kernel", "checksum_kernel"} <= names, names
    # compiled afresh (no kernel from Triton's cache), so that the compile times are real
    r = _run(COMPILE, dict(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_ALWAYS_COMPILE="1"),
             str(launches))
    assert r.returncode == 0, f"a kernel does not compile for sm_90:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert "compiled" in r.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton and torch")
def test_projection_tiles_are_tuned_per_input_dtype():
    """Inputs read by address reach the projection as int64 address tables whatever their dtype, so
    the autotuner's key must name X_DTYPE: a tile tuned for bf16 inputs was reused for float32 ones and
    failed to launch on an H100 (out of shared memory)."""
    from shared import _rdquant_triton

    for tuned in (_rdquant_triton.project_quantize_tuned, _rdquant_triton.project_quantize_wide_tuned):
        assert "X_DTYPE" in tuned.keys and "X_DTYPE" in tuned.arg_names
