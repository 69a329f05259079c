"""Exceptions. Each message names the cause and, where there is one, the fix."""


class TensorCodecError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidTensorError(TensorCodecError, ValueError):
    """The tensor handed in cannot be coded: NaN/Inf, wrong dtype, wrong rank, empty."""


class ConfigurationError(TensorCodecError, ValueError):
    """A codec was set up wrongly: an unknown backend or setting, a value out of range (qp, preset, zstd
    level, frame_size, a decode limit), a missing step."""


class BasisMismatchError(TensorCodecError, ValueError):
    """The basis does not fit the tensor or the bitstream (other D, other content hash)."""


class BitstreamError(TensorCodecError, ValueError):
    """The bitstream is truncated, corrupt (CRC mismatch), or names something unknown."""


class BackendUnavailable(TensorCodecError, RuntimeError):
    """A codec backend cannot run on this machine (library missing, no GPU, no NVENC...)."""


class UnknownBackend(ConfigurationError):
    """A codec backend name this build does not have; the message lists the known ones."""


class CodecError(TensorCodecError, RuntimeError):
    """A codec call failed. The message names the call, the status and a fix."""


class WeightsUnavailable(TensorCodecError, FileNotFoundError):
    """Model weights are not on this machine and no model hub can be reached; the message says how to provide them."""


class CodecFileMissing(TensorCodecError, FileNotFoundError):
    """A codec file the repository ships (or a step makes) is not on disk; the message names the command that
    rebuilds it."""


class TransferError(TensorCodecError, RuntimeError):
    """A transfer between processes failed: the peer died or stalled past the timeout, or sent a message
    that is not this stream's (another magic, version or stream id, a bad descriptor, a failed check)."""
