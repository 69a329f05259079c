"""tensorcodec helpers: PCA basis, quantizers, frame packing, codec backends, the bitstream container.

Importing this package never touches a GPU: GPU libraries are imported inside the backends that
need them, and asking for such a backend on a machine without one raises BackendUnavailable.
"""
from .errors import (  # noqa: F401
    TensorCodecError,
    InvalidTensorError,
    ConfigurationError,
    BasisMismatchError,
    BitstreamError,
    BackendUnavailable,
    UnknownBackend,
    CodecError,
    CodecFileMissing,
    TransferError,
)
