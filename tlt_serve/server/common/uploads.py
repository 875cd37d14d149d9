"""Chunked safetensors uploads for ``/update_weights_from_tensor``.

Protocol: ``POST /update_weights_from_tensor?chunk=i&num_chunks=n[&upload_id=u][&weight_version=v]``
with raw safetensors bytes (a slice of one file) as the body. Chunks of one upload arrive in
order 0..n-1; chunk 0 (re)starts the upload. Bytes go to a temporary file, not memory or the
engine pipe; when the last chunk lands the engine process loads the whole file, validates
every tensor, and swaps them in atomically between two steps (or changes nothing).
At most ``MAX_UPLOADS`` unfinished uploads are kept (their temp files are disk, not RAM).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tlt_serve.sampling_params import ParamError

MAX_CHUNKS = 100_000
MAX_UPLOADS = 4  # unfinished uploads kept at once; a new one beyond evicts the oldest
log = logging.getLogger("tlt_serve.uploads")


@dataclass
class _Upload:
    path: Path
    num_chunks: int
    next_chunk: int


class TensorUploads:
    """Uploads in progress, keyed by ``upload_id``. Event-loop thread only."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._uploads: dict[str, _Upload] = {}

    def begin_chunk(self, upload_id: str, chunk: int, num_chunks: int) -> Path:
        """Check the chunk's place in its upload; returns the file to append its bytes to."""
        if not 1 <= num_chunks <= MAX_CHUNKS:
            raise ParamError("num_chunks", f"must be in [1, {MAX_CHUNKS}], got {num_chunks}")
        if not 0 <= chunk < num_chunks:
            raise ParamError("chunk", f"must be in [0, {num_chunks}), got {chunk}")
        if chunk == 0:
            self.discard(upload_id)
            while len(self._uploads) >= MAX_UPLOADS:  # abandoned uploads must not pile up
                oldest = next(iter(self._uploads))
                log.warning("discarding unfinished upload %r: too many at once", oldest)
                self.discard(oldest)
            fd, name = tempfile.mkstemp(prefix="tlt-weights-", suffix=".safetensors",
                                        dir=self.directory)
            os.close(fd)
            self._uploads[upload_id] = _Upload(Path(name), num_chunks, 0)
        up = self._uploads.get(upload_id)
        if up is None:
            raise ParamError("chunk", f"upload {upload_id!r} has not started (send chunk 0)")
        if up.num_chunks != num_chunks or up.next_chunk != chunk:
            self.discard(upload_id)
            raise ParamError(
                "chunk", f"expected chunk {up.next_chunk} of {up.num_chunks}, got {chunk} of "
                f"{num_chunks}; the upload was discarded, start again from chunk 0",
            )
        return up.path

    def end_chunk(self, upload_id: str) -> Path | None:
        """Mark the current chunk received; returns the file once the upload is complete."""
        up = self._uploads[upload_id]
        up.next_chunk += 1
        if up.next_chunk < up.num_chunks:
            return None
        del self._uploads[upload_id]
        return up.path

    def discard(self, upload_id: str) -> None:
        up = self._uploads.pop(upload_id, None)
        if up is not None:
            up.path.unlink(missing_ok=True)

    def discard_all(self) -> None:
        for upload_id in list(self._uploads):
            self.discard(upload_id)
