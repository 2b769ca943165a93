"""A run's TensorBoard event files (``run_dir/tensorboard``).

TensorBoard is a convenience: without ``tensorboardX`` installed (the GPU image lacks it)
a run writes no events and everything else. ``tensorboardX`` is imported on first use,
not with the training loop, and without torch: where torch is installed, tensorboardX's
writer imports it only to accept its tensors (we log floats), 1.4 s of a CLI command's
start on 2 cores (3.1 s with the import against 0.4 s without, on a loaded machine).
"""

from __future__ import annotations

import os
import pathlib
import struct
import sys


def _tensorboardx():
    unloaded = "torch" not in sys.modules
    if unloaded:
        sys.modules["torch"] = None  # tensorboardX's `try: import torch` takes the ImportError
    try:
        import tensorboardX
        from tensorboardX.proto import event_pb2
        from tensorboardX import record_writer
    except ImportError:
        return None
    finally:
        if unloaded:
            del sys.modules["torch"]
    return tensorboardX, event_pb2, record_writer


def writer(directory: pathlib.Path):
    """A ``tensorboardX.SummaryWriter`` on ``directory``, or None without tensorboardX."""
    modules = _tensorboardx()
    return None if modules is None else modules[0].SummaryWriter(str(directory))


def _records(data: bytes) -> list[bytes]:
    """The records of a TFRecord file (each ``length: u64, crc: u32, data, crc: u32``);
    a last record torn by a kill is left out."""
    records, at = [], 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        if at + 16 + length > len(data):
            break
        records.append(data[at + 12:at + 12 + length])
        at += 16 + length
    return records


def truncate(directory: pathlib.Path, upto: int) -> None:
    """Drops the events of steps after ``upto`` from the event files in ``directory``, as
    the loop drops them from metrics.jsonl (a resumed run logs them again, and every
    reader, not only TensorBoard's purging one, shows each step once)."""
    modules = _tensorboardx()
    if modules is None:
        return
    _, event_pb2, record_writer = modules
    for path in sorted(directory.glob("events.out.tfevents.*")):
        kept = [r for r in _records(path.read_bytes()) if event_pb2.Event.FromString(r).step <= upto]
        scratch = directory / ".rewriting"  # not an event file name, should a kill leave it
        out = record_writer.RecordWriter(str(scratch))
        for record in kept:
            out.write(record)
        out.close()
        os.replace(scratch, path)
