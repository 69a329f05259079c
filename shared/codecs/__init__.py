"""Codec backends. `availability()` tells which run on this machine and why the others do not.

    from shared.codecs import get_backend, availability
    enc = get_backend("x265").encoder(256, 256, qp=None)   # qp=None: lossless

Backend modules register themselves on import; none of them imports a GPU library at import time.
"""
import importlib

from .base import (  # noqa: F401
    Backend,
    DecoderSession,
    EncoderSession,
    all_backends,
    availability,
    check_frames,
    get_backend,
    register,
    require_cuda,
)

# Each module registers its backends on import. GPU modules import their libraries lazily.
_MODULES = ["rans", "raw", "pyav", "ffmpeg_subprocess", "zstd_codec", "nvdec", "nvcomp"]
_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise
