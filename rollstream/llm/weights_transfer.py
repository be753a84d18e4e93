"""How new weights travel from the trainer's process to the built-in server's: a safetensors
file written straight from each tensor's memory (into tmpfs `/dev/shm` when both share a host,
a disk folder otherwise) and read back by the server as views of a mapping of it,
or, where both run on one GPU, CUDA IPC handles through which the server copies device to device.
Nothing here knows about HTTP; the trainer (trainer/weight_sync.py) chooses, the server loads."""

from __future__ import annotations

import base64
import contextlib
import json
import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch is imported where weights move: the CLI and a base install (no torch) import this module
    import torch

SHM_ROOT = Path("/dev/shm")
# the ways a sync can carry weights; "auto" picks one per sync (see choose_transfer)
Transfer = Literal["auto", "cuda_ipc", "shm", "disk"]



@cache
def _dtypes() -> tuple[dict, dict, dict]:
    """torch dtype -> safetensors name, that name -> torch dtype, torch's own name -> torch dtype."""
    import torch
    names = {
        torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    return (names, {name: dtype for dtype, name in names.items()},
            {str(dtype).removeprefix("torch."): dtype for dtype in names})


class WeightsFileError(ValueError):
    """A weights file or handle set that cannot be loaded (truncated, unknown dtype, ...)."""


# ---- the file ------------------------------------------------------------------------------
def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[int, int]]]:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    spans, offset = [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _dtypes()[0]:
            raise WeightsFileError(f"tensor {name} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _dtypes()[0][tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        spans.append((offset, offset + size))
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return encoded, spans


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None,
                      reuse: Path | None = None) -> None:
    """A .safetensors file written tensor by tensor straight from each tensor's memory: one copy
    into the file (safetensors' own save_file first makes a bytes object of every tensor); a GPU
    tensor goes through a pinned staging buffer, so its device-to-host copy runs at full speed.
    `reuse`, an older file of the same writer, is renamed to `path` and overwritten, so that a
    tmpfs keeps its pages instead of freeing and zeroing them again (measured here: write() into
    a file's existing pages beats copying into a shared mapping of it). The space is reserved
    first: a full tmpfs fails here with ENOSPC."""
    import torch
    header, spans = _layout(tensors, metadata)
    data_start = 8 + len(header)
    total = data_start + (spans[-1][1] if spans else 0)
    if reuse is not None and Path(reuse).is_file():
        os.replace(reuse, path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_blocks * 512 < total:  # walking pages a reused file has costs 0.2 s per GB on tmpfs
            os.posix_fallocate(fd, 0, total)
        os.ftruncate(fd, total)  # a reused file that was longer
        _write_all(fd, len(header).to_bytes(8, "little") + header)
        staging = _pinned_staging(tensors)
        for tensor in tensors.values():
            if not tensor.numel():
                continue
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if flat.device.type != "cpu":
                flat = staging[:flat.numel()].copy_(flat) if staging is not None else flat.cpu()
            _write_all(fd, memoryview(flat.numpy()))
    finally:
        os.close(fd)


class MappedWriter:
    """write_safetensors for a writer that rewrites the same file every sync (the shared-memory
    transfer): the file stays mapped between syncs, so a later write is one memcpy into pages
    already mapped, with no kernel pass over every 4 KiB page (0.25 s per 1.2 GB on tmpfs here).
    GPU tensors and files of another size or inode take write_safetensors."""

    def __init__(self) -> None:
        self._mapped: mmap.mmap | None = None
        self._inode: tuple[int, int] | None = None

    def write(self, tensors: dict[str, torch.Tensor], path: Path, reuse: Path | None = None) -> None:
        import torch
        header, spans = _layout(tensors, None)
        data_start = 8 + len(header)
        total = data_start + (spans[-1][1] if spans else 0)
        if reuse is not None and Path(reuse).is_file():
            os.replace(reuse, path)
        known = Path(path).stat() if Path(path).is_file() else None
        same = (known is not None and self._mapped is not None and len(self._mapped) == total
                and (known.st_dev, known.st_ino) == self._inode)
        if not same or any(t.device.type != "cpu" for t in tensors.values()) or not total:
            self.close()
            write_safetensors(tensors, path, reuse=None)
            if total and all(t.device.type == "cpu" for t in tensors.values()):
                fd = os.open(path, os.O_RDWR)
                try:
                    self._mapped = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                    st = os.fstat(fd)
                    self._inode = (st.st_dev, st.st_ino)
                finally:
                    os.close(fd)
            return
        assert self._mapped is not None
        self._mapped[:data_start] = len(header).to_bytes(8, "little") + header
        whole = torch.frombuffer(self._mapped, dtype=torch.uint8)
        with torch.no_grad():
            for tensor, (start, end) in zip(tensors.values(), spans):
                if end > start:
                    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                    whole[data_start + start : data_start + end].copy_(flat)
        del whole

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        self._mapped, self._inode = None, None


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _pinned_staging(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    import torch

    on_gpu = [t for t in tensors.values() if t.device.type == "cuda"]
    if not on_gpu:
        return None
    largest = max(t.numel() * t.element_size() for t in on_gpu)
    return torch.empty(largest, dtype=torch.uint8, pin_memory=True)


def _read_header(fd: int, size: int, path: Path) -> tuple[dict[str, Any], int]:
    if size < 8:
        raise WeightsFileError(f"{path} is {size} bytes, shorter than a safetensors header")
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if 8 + length > size:
        raise WeightsFileError(f"{path} is truncated: its header claims {length} bytes, the file has {size}")
    header = json.loads(os.pread(fd, length, 8))
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        if entry["dtype"] not in _dtypes()[1]:
            raise WeightsFileError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this server cannot load")
        if not 0 <= start <= end <= data_size:
            raise WeightsFileError(f"{path} is truncated: tensor {name} ends at byte {end} of {data_size}")
    return header, 8 + length


@contextlib.contextmanager
def mapped_safetensors(folder: Path) -> Iterator[dict[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors as a read-only view of a mapping of its file
    (no copy; the pages are faulted in by the kernel up front). Every file is checked against
    its header before anything is yielded: a file cut short is refused, not half-read."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        fd = os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            header, data_start = _read_header(fd, size, file)
            if not header:
                continue
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the file
        with warnings.catch_warnings():  # read-only on purpose: the copy_ reads, nothing writes
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            whole = torch.frombuffer(mapped, dtype=torch.uint8)
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            dtype, shape = _dtypes()[1][entry["dtype"]], entry["shape"]
            raw = whole[data_start + start : data_start + end]
            if (data_start + start) % dtype.itemsize:
                raw = raw.clone()  # a tensor after an odd-sized one: align it (rare, small)
            tensors[name] = raw.view(dtype).reshape(shape)
        del whole
    try:
        yield tensors
    finally:
        tensors.clear()  # the last view gone, the mapping is unmapped (and a deleted tmpfs file freed)


# ---- where the two processes are -------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where a process runs, as far as a weight transfer cares: the host's boot (same kernel),
    the identity of the tmpfs it sees at /dev/shm (a container has its own), its device."""

    boot_id: str
    shm: str | None  # "st_dev:st_ino" of /dev/shm, None where there is none to write
    device: str  # "cpu", "cuda:0", ...
    gpu_uuid: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def placement(device: torch.device | str = "cpu") -> Placement:
    import torch

    device = torch.device(device)
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    shm = None
    if SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK):
        st = SHM_ROOT.stat()
        shm = f"{st.st_dev}:{st.st_ino}"
    gpu_uuid = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu_uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "")) or None
        device = torch.device("cuda", index)
    return Placement(boot_id=boot_id, shm=shm, device=str(device), gpu_uuid=gpu_uuid)


def choose_transfer(requested: Transfer, trainer: Placement, servers: list[Placement | None]) -> str:
    """The transfer one sync uses. `auto`: CUDA IPC where the weights are on a GPU that every
    server uses too (same host, same GPU); else shared memory where every server sees the
    trainer's /dev/shm (same host and mount namespace; a server that did not say is assumed
    remote); else a disk folder, which must be one every server can read (shared storage)."""
    if requested != "auto":
        return requested
    known = [s for s in servers if s is not None]
    if not servers or len(known) < len(servers) or not trainer.boot_id:
        return "disk"
    same_host = all(s.boot_id == trainer.boot_id for s in known)
    if same_host and trainer.gpu_uuid is not None and all(s.gpu_uuid == trainer.gpu_uuid for s in known):
        return "cuda_ipc"
    if same_host and trainer.shm is not None and all(s.shm == trainer.shm for s in known):
        return "shm"
    return "disk"


# ---- CUDA IPC ------------------------------------------------------------------------------
def export_cuda_ipc(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """JSON-able CUDA IPC handles of GPU tensors (the fields torch.multiprocessing pickles, with
    classes and dtypes by name, so that the server never unpickles anything). The tensors must
    stay alive and unchanged until the server has copied them."""
    from torch.multiprocessing.reductions import reduce_tensor

    def b64(value: bytes | None) -> str | None:
        return None if value is None else base64.b64encode(value).decode()

    out = {}
    for name, tensor in tensors.items():
        if tensor.device.type != "cuda":
            raise WeightsFileError(f"tensor {name} is on {tensor.device}; CUDA IPC carries GPU tensors only")
        (
            _,
            (
                _,
                size,
                stride,
                offset,
                _,
                dtype,
                device,
                handle,
                storage_bytes,
                storage_offset_bytes,
                _,
                ref_handle,
                ref_offset,
                event_handle,
                event_sync,
            ),
        ) = reduce_tensor(tensor.detach())
        out[name] = {
            "size": list(size),
            "stride": list(stride),
            "offset": offset,
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "handle": b64(handle),
            "storage_bytes": storage_bytes,
            "storage_offset_bytes": storage_offset_bytes,
            "ref_handle": b64(ref_handle),
            "ref_offset": ref_offset,
            "event_handle": b64(event_handle),
            "event_sync": bool(event_sync),
        }
    return out


@contextlib.contextmanager
def cuda_ipc_tensors(handles: dict[str, dict[str, Any]]) -> Iterator[dict[str, torch.Tensor]]:
    """The exporting process's GPU tensors, opened in this process (same host, same GPU); closed
    again on leaving, so that the exporter may free or change them once told we are done."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise WeightsFileError("CUDA IPC handles sent to a server without CUDA; use the 'shm' or 'disk' transfer")

    def raw(value: str | None) -> bytes | None:
        return None if value is None else base64.b64decode(value)

    tensors = {}
    for name, h in handles.items():
        if h["dtype"] not in _dtypes()[2]:
            raise WeightsFileError(f"tensor {name}: dtype {h['dtype']!r} cannot be carried")
        tensors[name] = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(h["size"]),
            tuple(h["stride"]),
            int(h["offset"]),
            torch.UntypedStorage,
            _dtypes()[2][h["dtype"]],
            int(h["device"]),
            raw(h["handle"]),
            int(h["storage_bytes"]),
            int(h["storage_offset_bytes"]),
            False,
            raw(h["ref_handle"]),
            int(h["ref_offset"]),
            raw(h["event_handle"]),
            bool(h["event_sync"]),
        )
    try:
        yield tensors
    finally:
        tensors.clear()
