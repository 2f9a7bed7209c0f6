"""Checkpoint files for the twins: reading, writing and converting through the declared map.

Formats, chosen by the file's extension (or named explicitly):

- ``safetensors`` (``.safetensors``): either framework's layout.  PyTorch names
  (``W_query.weight``, (out, in)) or Flax paths joined with ``/`` (``W_query/kernel``,
  (in, out)); a file is read as Flax's layout when any name holds a ``/``.  Read and
  written here with NumPy alone (the format is a JSON header and raw little-endian
  bytes), so that bfloat16 survives (``safetensors.numpy`` has no bfloat16) and a
  truncated file is named as such; the files are the ones the ``safetensors`` library
  reads and writes.
- ``pt`` (``.pt``, ``.pth``): a PyTorch state dict, ``torch.save`` / ``torch.load(...,
  weights_only=True)``; PyTorch's layout.  Needs torch.
- ``msgpack`` (``.msgpack``): ``flax.serialization.msgpack_serialize`` of the nested dict
  of arrays (``{"W_query": {"kernel": ...}}``, ``{"heads": {"0": ...}}``); Flax's layout.
  Needs flax.
- ``orbax`` (a directory; any other name with ``format="orbax"``): the same nested dict
  through ``orbax.checkpoint.PyTreeCheckpointer``; Flax's layout.  Needs orbax-checkpoint.

This module imports no framework at import time; each reader or writer imports the one
its format needs.  Every write goes to a temporary name in the destination's directory
and is renamed over the destination only when complete (``os.replace``); on any failure
the temporary is removed and an existing destination is left as it was.  Nothing this
library did not write is replaced: a file format refuses an existing directory, and an
Orbax checkpoint replaces an existing directory only when it is one of ours (each holds
``twin_attention_checkpoint.json``, the list of its files) with nothing added since.  A
symlink destination is written through; a new file gets the mode ``open()`` would give
it (0666 less the umask), a replaced one keeps its mode.

Errors: ``CheckpointError`` (a ``ValueError``) for an unreadable, truncated or malformed
file, an unknown format, a layout that the format cannot hold or a destination that must
not be replaced, each naming the user's path; ``OSError`` naming the user's path (never
the temporary) when a write fails; the declared weight map's own ``ValueError`` /
``TypeError`` (``attention_spec.interop.conversion``) for missing, unexpected or misshaped
parameters and non-floating arrays; the registry's for an unknown variant or a
bad config.  Everything is checked before anything is written.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path as FsPath
from typing import Any

import numpy as np

from attention_spec.interop.conversion import flax_to_torch, rules_for, torch_to_flax
from attention_spec.interop.numpy_arrays import Path, as_numpy, check_float_arrays, flatten_paths
from attention_spec.registry import AttentionConfig, make_config, variant
from attention_spec.rope import rope_from_mapping

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "CheckpointError",
    "checked_config",
    "convert_file",
    "flax_names",
    "format_for",
    "layout_of",
    "read_arrays",
    "read_checkpoint",
    "read_safetensors",
    "to_layout",
    "write_arrays",
    "write_checkpoint",
    "write_safetensors",
]

FORMATS: tuple[str, ...] = ("safetensors", "pt", "msgpack", "orbax")
LAYOUTS: tuple[str, ...] = ("torch", "flax")
_EXTENSIONS = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt", ".msgpack": "msgpack"}
# The layout a format holds (None: either, told by the names).
_FORMAT_LAYOUT = {"safetensors": None, "pt": "torch", "msgpack": "flax", "orbax": "flax"}


class CheckpointError(ValueError):
    """A file that cannot be read as the format it claims, an unknown format, or a layout
    that the format cannot hold."""


# --------------------------------------------------------------------------- formats


def format_for(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The format of ``path``: ``format`` if given (checked), else from the extension
    (``.safetensors``, ``.pt``/``.pth``, ``.msgpack``; an existing directory is Orbax).
    Raises CheckpointError for an unknown format or extension."""
    if format is not None:
        if format not in FORMATS:
            raise CheckpointError(f"unknown format {format!r}; known formats: {', '.join(FORMATS)}")
        return format
    suffix = FsPath(path).suffix.lower()
    if suffix in _EXTENSIONS:
        return _EXTENSIONS[suffix]
    if os.path.isdir(path):
        return "orbax"
    raise CheckpointError(
        f"cannot tell the format of {os.fspath(path)!r} from its extension {suffix or '(none)'!r}: "
        "use .safetensors, .pt, .pth or .msgpack, or name the format (safetensors, pt, msgpack, orbax)"
    )


def layout_of(names: Any) -> str:
    """``"flax"`` when any name is a ``/``-joined path, else ``"torch"`` (a variant whose
    names have no separator, ``SelfAttention_v1``'s ``W_query``, reads the same either way)."""
    return "flax" if any("/" in str(n) for n in names) else "torch"


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100_000_000  # as the safetensors library: a bigger header is not a safetensors file


def _bfloat16() -> Any:
    import ml_dtypes  # comes with jax; torch-only installs read bfloat16 through it as well

    return ml_dtypes.bfloat16


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(_bfloat16()) if name == "bfloat16" else np.dtype(name)


def write_safetensors(
    arrays: Mapping[str, Any], path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """Writes {name: array} as a safetensors file at ``path`` (not atomically: see
    ``write_arrays``).  Raises CheckpointError for a dtype that safetensors cannot hold."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name, value in arrays.items():
        a = np.ascontiguousarray(as_numpy(value))
        code = _ST_CODES.get(a.dtype.name)
        if code is None:
            raise CheckpointError(f"safetensors cannot hold {name!r} of dtype {a.dtype}")
        if a.dtype.byteorder == ">":  # safetensors is little-endian
            a = a.astype(a.dtype.newbyteorder("<"))
        data = a.tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)


def _read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The whole file, or CheckpointError naming it (never an OSError)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {os.fspath(path)!r}: {e.strerror or e}") from None


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """{name: NumPy array} from a safetensors file, every array a copy.  Raises
    CheckpointError naming the file (and the entry) for a file that is truncated or whose
    header is malformed, as the safetensors library checks it: every entry a ``dtype`` it
    knows, a ``shape`` of non-negative integers and two ``data_offsets`` within the data
    whose span is the shape's size in bytes, the entries covering the data exactly once
    (no gap, no overlap, nothing after), ``__metadata__`` a mapping of strings."""
    where = os.fspath(path)
    blob = _read_bytes(path)
    if len(blob) < 8:
        raise CheckpointError(f"{where!r} is not a safetensors file (truncated: {len(blob)} bytes)")
    size = int.from_bytes(blob[:8], "little")
    if size > _MAX_HEADER:
        raise CheckpointError(f"{where!r} is not a safetensors file (header length {size})")
    if 8 + size > len(blob):
        raise CheckpointError(f"{where!r} is truncated: its header needs {8 + size} bytes, the file has {len(blob)}")
    try:
        header = json.loads(blob[8:8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{where!r} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where!r} is not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where!r} has a malformed header: __metadata__ must map names to strings, "
                              f"not {metadata!r}")
    data = memoryview(blob)[8 + size:]
    spans = {name: _entry_span(where, name, entry, len(data)) for name, entry in header.items()}
    # As the library: sorted by offset, the entries tile the data from its first byte to its last.
    end = 0
    for name, (_dtype, _shape, begin, stop) in sorted(spans.items(), key=lambda item: item[1][2:]):
        if begin != end:
            raise CheckpointError(f"{where!r} has a malformed header: the data_offsets of {name!r} begin at "
                                  f"byte {begin}, not {end} (the entries must cover the data once, in order, "
                                  "with no gap or overlap)")
        end = stop
    if end != len(data):
        raise CheckpointError(f"{where!r} has a malformed header: {len(data) - end} bytes of data after "
                              "the last entry's")
    arrays: dict[str, np.ndarray] = {}
    for name, (dtype, shape, begin, stop) in spans.items():
        if dtype.itemsize > 1 and dtype.name != "bfloat16":
            dtype = dtype.newbyteorder("<")
        arrays[name] = np.frombuffer(data[begin:stop], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    return arrays


def _is_count(value: Any) -> bool:
    """A JSON integer (not a bool, a float or a string) that is not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_span(where: str, name: str, entry: Any, data_size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked; CheckpointError
    naming the file and the entry otherwise."""
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{where!r} has a malformed header entry for {name!r}: {problem}")

    if not isinstance(entry, dict):
        raise bad(f"{entry!r} is not a JSON object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        raise bad(f"no {', '.join(missing)} in {entry!r}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in _ST_DTYPES:
        raise bad(f"dtype {code!r} is not one of {', '.join(_ST_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise bad(f"shape {shape!r} is not a list of integers")
    if not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} has a negative dimension")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets {offsets!r} end before they begin")
    if end > data_size:
        raise CheckpointError(
            f"{where!r} is truncated: {name!r} needs bytes {begin}..{end} of the data, the file has {data_size}"
        )
    dtype = _np_dtype(_ST_DTYPES[code])
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{where!r}: the data of {name!r} ({end - begin} bytes) does not fit "
                              f"shape {tuple(shape)} of {code}")
    return dtype, tuple(shape), begin, end


# --------------------------------------------------------------------------- other formats


def _read_pt(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    import pickle
    import zipfile

    import torch

    where = os.fspath(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"cannot read {where!r}: no such file") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read {where!r} as a PyTorch state dict (truncated or not one): "
                              f"{first}") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{where!r} does not hold a PyTorch state dict (a mapping of names to tensors)")
    return {str(k): as_numpy(v).copy() for k, v in state.items()}


def _write_pt(arrays: Mapping[str, np.ndarray], path: str) -> None:
    import torch

    state = {}
    for name, a in arrays.items():
        if a.dtype.name == "bfloat16":  # NumPy has no bfloat16: the bits, reinterpreted
            state[name] = torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
        else:
            state[name] = torch.from_numpy(np.array(a))
    with open(path, "wb") as f:  # our file object: a failed write is the OSError saying why, not torch's
        torch.save(state, f)


def _nested(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, a in arrays.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = a
    return tree


def _flat_names(tree: Any, where: str) -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(f"{prefix}/{key}" if prefix else str(key), child)
        else:
            try:
                flat[prefix] = as_numpy(node)
            except Exception:  # noqa: BLE001 - anything that is not an array is a malformed file
                raise CheckpointError(f"{where!r} holds {type(node).__name__} at {prefix!r}, not an array") from None

    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{where!r} does not hold a nested dict of arrays")
    walk("", tree)
    return flat


def _read_msgpack(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    from flax import serialization

    where = os.fspath(path)
    blob = _read_bytes(path)
    try:
        tree = serialization.msgpack_restore(blob)
    except Exception as e:  # noqa: BLE001 - msgpack raises a family of its own errors
        raise CheckpointError(f"cannot read {where!r} as Flax msgpack (truncated or not one): "
                              f"{type(e).__name__}") from None
    return _flat_names(tree, where)


def _write_msgpack(arrays: Mapping[str, np.ndarray], path: str) -> None:
    from flax import serialization

    with open(path, "wb") as f:
        f.write(serialization.msgpack_serialize(_nested(arrays)))


def _read_orbax(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    where = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"cannot read {where!r}: an Orbax checkpoint is a directory")
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            tree = checkpointer.restore(os.path.abspath(path))
    except Exception as e:  # noqa: BLE001 - Orbax raises many kinds for a damaged directory
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read {where!r} as an Orbax checkpoint: {first}") from None
    return _flat_names(tree, where)


def _write_orbax(arrays: Mapping[str, np.ndarray], path: str) -> None:
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), _nested({k: np.asarray(a) for k, a in arrays.items()}))


_READERS: dict[str, Callable[[str | os.PathLike[str]], dict[str, np.ndarray]]] = {
    "safetensors": read_safetensors, "pt": _read_pt, "msgpack": _read_msgpack, "orbax": _read_orbax,
}


# --------------------------------------------------------------------------- reading and writing


def read_arrays(path: str | os.PathLike[str], format: str | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """(layout, {name: array}) from a file: the layout is ``"torch"`` (names such as
    ``W_query.weight``) or ``"flax"`` (``/``-joined paths such as ``W_query/kernel``).
    Raises CheckpointError for an unknown format or an unreadable file."""
    fmt = format_for(path, format)
    if fmt != "orbax" and os.path.isdir(path):
        raise CheckpointError(f"cannot read {os.fspath(path)!r}: it is a directory, and a {fmt} checkpoint is a file")
    if fmt != "orbax" and not os.path.isfile(path):
        raise CheckpointError(f"cannot read {os.fspath(path)!r}: no such file")
    arrays = _READERS[fmt](path)
    return _FORMAT_LAYOUT[fmt] or layout_of(arrays), arrays


def _check_layout(fmt: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; known layouts: torch, flax")
    holds = _FORMAT_LAYOUT[fmt]
    if holds is not None and holds != layout:
        fits = [f for f, held in _FORMAT_LAYOUT.items() if held in (None, layout)]
        raise CheckpointError(f"a {fmt} file holds {holds} layout, not {layout}; {layout} layout goes to "
                              + ", ".join(fits))


def write_arrays(
    arrays: Mapping[str, np.ndarray], path: str | os.PathLike[str], *, layout: str, format: str | None = None
) -> None:
    """Writes {name: array} (PyTorch names for ``layout="torch"``, ``/``-joined Flax paths
    for ``"flax"``) atomically: to a temporary name in the same directory, renamed over
    ``path`` when complete; on failure the temporary is removed and ``path`` is untouched.

    A symlink ``path`` is written through (its target is replaced, the link stays).  A new
    file gets the mode ``open()`` gives one (0666 less the umask), a replaced file keeps its
    own.  Nothing that this library did not write is replaced: an existing directory is
    replaced only by an Orbax checkpoint and only when it is one of ours (``_ORBAX_MARKER``
    lists what it holds, and it holds nothing else); a file format refuses a directory or
    anything else that is not a regular file.

    Raises CheckpointError (naming ``path``) for an unknown format, a layout that it cannot
    hold or a destination it must not replace, before anything is written; OSError naming
    ``path`` (not the temporary) when the write itself fails (a full disk, a missing or
    read-only directory)."""
    fmt = format_for(path, format)
    _check_layout(fmt, layout)
    where = os.fspath(path)
    target = _destination(path, fmt)
    directory = os.path.dirname(target)
    if fmt == "orbax":
        _guarded(where, target, lambda: _replace_dir(target, directory, where, lambda tmp: _write_orbax(arrays, tmp)))
        return
    writer: Callable[[str], None]
    if fmt == "safetensors":
        def writer(tmp: str) -> None:
            write_safetensors(arrays, tmp, {"format": "pt" if layout == "torch" else "flax"})
    elif fmt == "pt":
        def writer(tmp: str) -> None:
            _write_pt(arrays, tmp)
    else:
        def writer(tmp: str) -> None:
            _write_msgpack(arrays, tmp)
    _guarded(where, target, lambda: _replace_file(target, directory, writer))


# What every Orbax checkpoint of ours holds besides Orbax's own files: the list of those
# files, so that a directory is replaced only when it is a checkpoint this library wrote
# and nothing has been added to it since.
_ORBAX_MARKER = "twin_attention_checkpoint.json"


def _destination(path: str | os.PathLike[str], fmt: str) -> str:
    """The absolute path to replace for ``path`` (a symlink's target, as ``open()`` writes
    through one), after checking that it may be replaced: CheckpointError naming ``path``
    otherwise."""
    where = os.fspath(path)
    target = os.path.realpath(path)
    if fmt == "orbax":
        if os.path.isdir(target):
            _check_ours(target, where)
        elif os.path.lexists(target):
            raise CheckpointError(f"cannot write an Orbax checkpoint to {where!r}: it exists and is not a "
                                  "directory (an Orbax checkpoint is one); name a new directory instead")
    elif os.path.isdir(target):
        raise CheckpointError(f"cannot write {where!r}: it is a directory, and a {fmt} checkpoint is a file; "
                              "name a file in it, or remove it")
    elif os.path.lexists(target) and not os.path.isfile(target):
        raise CheckpointError(f"cannot write {where!r}: it exists and is not a regular file")
    return target


def _entries(directory: str) -> set[str]:
    """Every file and directory under ``directory``, relative, ``/``-separated (the marker left out)."""
    found = set()
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            found.add(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
    found.discard(_ORBAX_MARKER)
    return found


def _check_ours(directory: str, where: str) -> None:
    """CheckpointError naming ``where`` unless ``directory`` is an Orbax checkpoint this
    library wrote, holding nothing that it did not write."""
    try:
        with open(os.path.join(directory, _ORBAX_MARKER), encoding="utf-8") as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"refusing to replace {where!r}: it is a directory that is not an Orbax checkpoint written by "
            f"twin-attention (no readable {_ORBAX_MARKER} in it); name a new directory instead"
        ) from None
    added = sorted(_entries(directory) - set(listed if isinstance(listed, list) else []))
    if added:
        shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
        raise CheckpointError(f"refusing to replace {where!r}: this Orbax checkpoint holds files that "
                              f"twin-attention did not write ({shown}); remove them or name a new directory")


def _guarded(where: str, target: str, write: Callable[[], None]) -> None:
    """Runs ``write`` (which writes ``target``, the real path of ``where``); a failure of
    the write itself becomes an OSError naming ``where``, the user's path, never the
    temporary name it was writing (the type and errno of an OSError kept).  Our own
    CheckpointError passes through."""
    try:
        write()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.save and Orbax report a failed write in their own types
        code = e.errno if isinstance(e, OSError) else None
        if isinstance(e, OSError) and e.strerror:
            detail = e.strerror
        else:
            detail = (str(e).splitlines() or [type(e).__name__])[0]
            # Orbax (tensorstore) reports the system's error as a code inside a long message.
            found = re.search(r"os_error_code='(\d+)'", detail)
            if found:
                code = int(found.group(1))
                detail = os.strerror(code)
            # anything else that names the hidden temporary names OUT instead
            hidden = re.escape(os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.")) + r"\w+\.tmp"
            detail = re.sub(hidden + r"[^\s'\"]*", where, detail)
        error = (type(e) if isinstance(e, OSError) else OSError)(f"cannot write {where!r}: {detail}")
        error.errno = code
        raise error from e


def _temporary_file(directory: str, base: str) -> str:
    """A new empty file ``.<base>.<random>.tmp`` in ``directory``, created as ``open()``
    creates a file (0666 less the umask), which ``mkstemp``'s 0600 is not."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", directory)


def _replace_file(target: str, directory: str, write: Callable[[str], None]) -> None:
    """A file written under a temporary name, then renamed over ``target`` (which keeps the
    mode an existing ``target`` had)."""
    tmp = _temporary_file(directory, os.path.basename(target))
    try:
        if os.path.isfile(target):
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _replace_dir(target: str, directory: str, where: str, write: Callable[[str], None]) -> None:
    """A directory written under a temporary name, marked as ours, then moved into place:
    an existing ``target`` (checked again to be ours, as it may have changed during the
    write) is set aside first and removed only once the new one is in place."""
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    tmp = os.path.join(staging, "checkpoint")  # Orbax writes a directory that must not exist yet
    old = None
    try:
        write(tmp)
        with open(os.path.join(tmp, _ORBAX_MARKER), "w", encoding="utf-8") as f:
            json.dump({"written_by": "twin-attention", "format": "orbax", "files": sorted(_entries(tmp))}, f)
        if os.path.lexists(target):
            _check_ours(target, where)
            old = os.path.join(staging, "previous")
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        if old is not None and not os.path.lexists(target):
            os.replace(old, target)
        _remove_staging(staging)
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _remove_staging(staging: str) -> None:
    """Removes a staging directory after a failed write.  Orbax's writer threads
    (tensorstore) may then still be creating files in it for a moment, which makes a
    single ``rmtree`` leave it behind: it is removed until it has stayed gone a while."""
    gone_since = None
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if os.path.lexists(staging):
            shutil.rmtree(staging, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= 0.2:
            return
        time.sleep(0.02)


# --------------------------------------------------------------------------- through the map


def checked_config(name: str, config: Mapping[str, Any] | AttentionConfig | None) -> AttentionConfig:
    decl = variant(name)  # ValueError naming the known variants
    if isinstance(config, AttentionConfig):
        return config
    options = dict(config or {})
    unknown = sorted(set(options) - set(decl.options))
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(map(repr, unknown))}; its options: "
                         + ", ".join(decl.options))
    if isinstance(options.get("rope"), Mapping):  # a JSON object (--config): the RopeConfig's fields
        options["rope"] = rope_from_mapping(options["rope"])
    return make_config(name, options)


def flax_names(flat: Mapping[Path, np.ndarray]) -> dict[str, np.ndarray]:
    """{Flax path tuple: array} -> {``/``-joined name: array}, the names files hold."""
    return {"/".join(str(p) for p in path): a for path, a in flat.items()}


def to_layout(
    arrays: Mapping[str, np.ndarray], layout: str, to: str, variant_name: str,
    config: Mapping[str, Any] | AttentionConfig | None,
) -> dict[str, np.ndarray]:
    """Arrays in ``layout`` -> the same arrays in layout ``to`` (names ``W_query.weight`` or
    ``W_query/kernel``), through the declared map of the variant and config: every name
    and shape checked (ValueError listing missing, unexpected and misshaped ones), every
    array floating (TypeError).  Bit-exact: only transposes and renames."""
    if to not in LAYOUTS:
        raise CheckpointError(f"unknown layout {to!r}; known layouts: torch, flax")
    rules = rules_for(variant_name, checked_config(variant_name, config))
    if layout == "torch":
        flax = torch_to_flax(arrays, rules)
        check_float_arrays(arrays, "the PyTorch state_dict")
        torch_named = dict(arrays)
    else:
        flat = flatten_paths(dict(arrays))
        torch_named = flax_to_torch(flat, rules)
        check_float_arrays(flat, "the Flax state")
        flax = {r.flax_path: flat[r.flax_path] for r in rules}
    if to == "torch":
        return {r.torch_name: np.ascontiguousarray(torch_named[r.torch_name]) for r in rules}
    return flax_names({r.flax_path: np.ascontiguousarray(flax[r.flax_path]) for r in rules})


def read_checkpoint(
    path: str | os.PathLike[str], variant_name: str, config: Mapping[str, Any] | AttentionConfig | None = None,
    *, to: str, format: str | None = None,
) -> dict[str, np.ndarray]:
    """A checkpoint file of either layout, checked against the variant's declared map and
    given in layout ``to`` (``"torch"``: {``W_query.weight``: array}; ``"flax"``:
    {``W_query/kernel``: array})."""
    layout, arrays = read_arrays(path, format)
    return to_layout(arrays, layout, to, variant_name, config)


def write_checkpoint(
    arrays: Mapping[str, np.ndarray], path: str | os.PathLike[str], *, layout: str, format: str | None = None,
) -> None:
    """``write_arrays`` under its name for checkpoints (already checked arrays)."""
    write_arrays(arrays, path, layout=layout, format=format)


def convert_file(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str, variant_name: str,
    config: Mapping[str, Any] | AttentionConfig | None = None,
    src_format: str | None = None, dst_format: str | None = None,
) -> dict[str, np.ndarray]:
    """Reads ``src`` (either layout), checks it against the declared map and writes it to
    ``dst`` in layout ``to`` (atomically); returns what was written.  Everything (the
    destination's format and layout included) is checked before anything is written."""
    fmt = format_for(dst, dst_format)
    _check_layout(fmt, to)
    _destination(dst, fmt)  # a directory or file that must not be replaced, before the input is read
    checked_config(variant_name, config)  # an unknown variant or a bad config before the file is read
    arrays = read_checkpoint(src, variant_name, config, to=to, format=src_format)
    write_arrays(arrays, dst, layout=to, format=fmt)
    return arrays
