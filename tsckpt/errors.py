"""Exceptions raised by tsckpt, every class importable from ``tsckpt``.

Every error a user can trigger with bad input or a broken checkpoint is a ``TsckptError``, so callers can catch
one class and show one clear line; each raise site uses the most specific class below, so callers can also
tell a bad argument from a broken store from a damaged checkpoint.

Ctrl-C during a save stays a ``KeyboardInterrupt`` (so ``except Exception`` does not swallow it), whose message
says what the save left where (:mod:`tsckpt.dcp.failure`).
"""

from __future__ import annotations


class TsckptError(Exception):
    """Base class of every error tsckpt raises on purpose.

    ``relayed_from``: for an error one rank raises for another (with replica reads, the rank that fetched a
    region several ranks need sends its failure to them), the rank where it happened; None for its own errors.
    """

    relayed_from: int | None = None

    def __init__(self, *args: object, relayed_from: int | None = None):
        super().__init__(*args)
        self.relayed_from = relayed_from


class IncompleteCheckpointError(TsckptError):
    """The directory has no committed metadata: the save did not finish."""


class CheckpointNotFoundError(TsckptError):
    """Nothing exists at the given location."""


class CheckpointExistsError(TsckptError):
    """A complete checkpoint is already there and overwriting was not asked for.

    The message starts with "Checkpoint already exists", as DCP's does.
    """


class ForeignContentError(TsckptError):
    """The location holds Zarr data tsckpt did not write (a plain Zarr group, another tool's arrays), which a save
    never writes over or among, whatever ``overwrite`` says; other files there are saved beside."""


class ConcurrentSaveError(TsckptError):
    """Another save into the same location is running, died without finishing, or overtook this one."""


class MetadataError(TsckptError):
    """The metadata document is malformed, unsupported or inconsistent."""


class UnsupportedVersionError(MetadataError):
    """The checkpoint is in a format version this tsckpt does not read; the message names the release that does."""


class UnsupportedDtypeError(TsckptError):
    """A tensor's dtype has no Zarr v3 equivalent that tsckpt can store bit-exactly."""


class PlanError(TsckptError):
    """The regions planned for a tensor overlap, leave gaps or fall outside it."""


class LoadMismatchError(TsckptError):
    """The state dict being loaded does not match the checkpoint."""


class UnsafeObjectError(TsckptError):
    """A non-tensor value can only be restored by running code from the checkpoint."""


class ChecksumError(TsckptError):
    """Stored data does not match the checksum recorded when it was written."""


class DamagedValueError(TsckptError):
    """A stored non-tensor value is corrupt: its bytes are not an intact ``torch.save`` archive."""


class NotACheckpointError(TsckptError):
    """The location holds something other than a tsckpt checkpoint (a file, a DCP checkpoint)."""


class StorageError(TsckptError):
    """The storage behind a location failed: a missing bucket, an unreachable endpoint, a refusal."""


class FileInTheWayError(NotACheckpointError, ForeignContentError):
    """A regular file sits where the checkpoint directory, or a directory or file of a save, should be (refused
    whatever ``overwrite`` says)."""


class OptionError(TsckptError, ValueError):
    """An argument or setting is invalid: a bad option value, a combination tsckpt cannot honour, a call out of order."""


class LocationError(TsckptError, ValueError):
    """A checkpoint location (path, URL or kvstore spec) cannot be parsed or is not a usable place for checkpoints."""


class ConversionError(TsckptError):
    """A conversion source or target cannot be read or written in the format asked for."""


class SaveFailedError(TsckptError):
    """A save failed on one or more ranks (an error there, or Ctrl-C on another rank); nothing was committed.

    The first line names the location, the rank and the problem; the message also says whether what the save
    had staged was removed, or what is left where and the command that removes it.
    """
