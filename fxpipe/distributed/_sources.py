"""Where this rank's weights come from: ``state_dict=`` of :func:`fxpipe.distributed.pipeline`.

A rank reads only the keys of its own stages, so that a model too big for one host is never
whole in any process. The forms ``state_dict=`` takes, each read as lazily as it allows:

* a mapping ``{key: tensor}`` (already in memory: only the local keys are copied);
* the path of a file written by ``torch.save(model.state_dict(), path)``: opened with
  ``torch.load(mmap=True, weights_only=True)``, so only the pages of the local keys are read;
* the path of a ``torch.distributed.checkpoint`` directory (``dcp.save(model.state_dict(),
  checkpoint_id=path)``, or a training loop's ``dcp.save({"model": ..., "optim": ...})``, whose
  keys are found under ``model.``): each rank asks ``dcp.load`` for its keys alone (a collective call);
* a ``torch.distributed.checkpoint`` ``StorageReader``, read the same way: e.g.
  ``dcp.HuggingFaceStorageReader(folder)`` reads the ``*.safetensors`` files of a folder;
* a callable ``keys -> mapping``: called with this rank's keys (every name of each tensor,
  tied weights included), returns tensors for them (a safetensors shard reader, a custom
  format); it may leave out all but one name of a tied weight.

Keys are the model's own ``state_dict()`` keys. Reading is in two steps: :meth:`Source.keys`
and :meth:`Source.shape` first (no tensor data, no collective), so that every rank can check
its keys and agree before anything is loaded; then :meth:`Source.read` copies the values into
the rank's tensors in place (for a checkpoint directory this is the collective ``dcp.load``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # torch.distributed.checkpoint takes seconds to import: only when a checkpoint is read
    from torch.distributed.checkpoint import StorageReader

from fxpipe.errors import MaterialiseError

from ._sharding import placed_like

__all__ = ["StateDictSource", "Source", "open_source"]

#: what ``state_dict=`` accepts (see the module docstring)
StateDictSource = Union[Mapping, str, os.PathLike, "StorageReader", Callable[[Sequence[str]], Mapping]]


class Source:
    """A state dict's keys and shapes, and a way to copy its values into given tensors."""

    collective = False  #: whether :meth:`read` is a collective call (every rank must make it)

    def __init__(self, values: Mapping, where: str) -> None:
        self._values = values
        self.where = where  #: the source, as error messages name it

    def keys(self) -> set[str]:
        return {k for k, v in self._values.items() if isinstance(v, torch.Tensor)}

    def shape(self, key: str) -> torch.Size:
        return self._values[key].shape

    def read(self, targets: dict[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        """Copies each ``targets[key]``'s value from the source, in place (casting the dtype,
        as ``load_state_dict`` does)."""
        with torch.no_grad():
            for key, target in targets.items():
                value = self._values[key]
                if value.is_meta:
                    raise MaterialiseError(f"{self.where} holds {key!r} on the meta device, with no values: "
                                           "give a state_dict whose tensors are real (on the CPU)")
                target.copy_(placed_like(value, target))  # a DTensor ('fsdp'): this rank's shard of it


class Checkpoint(Source):
    """A ``torch.distributed.checkpoint`` storage: its metadata now, its data by ``dcp.load``."""

    collective = True

    def __init__(self, reader: "StorageReader", where: str) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        super().__init__({}, where)
        self._reader = reader
        try:
            metadata = reader.read_metadata().state_dict_metadata
        except Exception as e:
            raise MaterialiseError(f"{where} cannot be read as a torch.distributed.checkpoint ({type(e).__name__}: "
                                   f"{e}): give the directory dcp.save(..., checkpoint_id=...) wrote, or the path of "
                                   "a file torch.save wrote") from e
        self._shapes = {k: m.size for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}

    def _stored(self, key: str) -> str:
        """The name ``key`` is stored under: as it is, or under ``model.`` -- a training loop's
        checkpoint, ``dcp.save({"model": pipe.state_dict(), "optim": ...})`` (the guide's)."""
        return key if key in self._shapes or _WRAPPED + key not in self._shapes else _WRAPPED + key

    def keys(self) -> set[str]:
        return set(self._shapes) | {k[len(_WRAPPED):] for k in self._shapes if k.startswith(_WRAPPED)}

    def shape(self, key: str) -> torch.Size:
        return self._shapes[self._stored(key)]

    def read(self, targets: dict[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load({self._stored(k): t for k, t in targets.items()}, storage_reader=self._reader, process_group=group)


#: where a training loop's checkpoint keeps the model's keys
_WRAPPED = "model."


def open_source(state_dict: StateDictSource, wanted: Sequence[str]) -> Source:
    """The :class:`Source` ``state_dict=`` names; ``wanted`` (this rank's keys) is what a
    callable is asked for. Reads no tensor data, except what a callable chooses to."""
    if isinstance(state_dict, Mapping):
        return Source(state_dict, "state_dict")
    from torch.distributed.checkpoint import FileSystemReader, StorageReader

    if isinstance(state_dict, StorageReader):
        return Checkpoint(state_dict, f"the checkpoint {type(state_dict).__name__}")
    if isinstance(state_dict, (str, os.PathLike)):
        path = os.fspath(state_dict)
        if os.path.isdir(path):
            return Checkpoint(FileSystemReader(path), f"the checkpoint directory {path!r}")
        if not os.path.isfile(path):
            raise MaterialiseError(f"state_dict={path!r}: there is no file or directory there. Give the path of a "
                                   "file torch.save(model.state_dict(), path) wrote, or of a directory "
                                   "torch.distributed.checkpoint.save wrote")
        try:
            values = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise MaterialiseError(f"state_dict={path!r} cannot be read as a torch.save file with "
                                   f"torch.load(mmap=True, weights_only=True) ({type(e).__name__}: {e}); save it with "
                                   "torch.save(model.state_dict(), path), or pass a callable that reads it") from e
        return Source(_mapping(values, f"the file {path!r}"), f"the file {path!r}")
    if callable(state_dict):
        name = getattr(state_dict, "__qualname__", type(state_dict).__name__)
        return Source(_mapping(state_dict(list(wanted)), f"state_dict callable {name}"),
                      f"what the state_dict callable {name} returned")
    raise TypeError(f"state_dict must be a mapping of tensors, the path of a torch.save file or of a "
                    f"torch.distributed.checkpoint directory, a torch.distributed.checkpoint StorageReader, or a "
                    f"callable keys -> mapping; "
                    f"got {type(state_dict).__name__}")


def _mapping(values: object, what: str) -> Mapping:
    if not isinstance(values, Mapping):
        raise MaterialiseError(f"{what} gave a {type(values).__name__}, not a mapping of key -> tensor "
                               "(a state_dict)")
    return values


def missing_message(source: Source, missing: list[str], have: Optional[set[str]] = None) -> str:
    """What to say when ``missing`` keys are not in ``source``: a few of them, and a few of the
    keys it has (a prefix such as ``model.`` shows at once)."""
    have = source.keys() if have is None else have
    some = sorted(have)[:5]
    return (f"{source.where} has no {_few(missing)}, which this rank's stages use. It has {len(have)} "
            f"tensor keys{', e.g. ' + ', '.join(map(repr, some)) if some else ''}. Keys must be the model's own "
            "state_dict() keys (a tied weight needs one of its names)")


def _few(keys: list[str], n: int = 5) -> str:
    shown = ", ".join(map(repr, keys[:n]))
    return f"{shown} (and {len(keys) - n} more)" if len(keys) > n else shown
