"""The chunk metadata of vLLM's varlen SSD prefill, built the way its model runner builds it.

vLLM packs the prefill tokens of a batch's requests one after another (token-major, no padding) and cuts them
into *logical chunks* that cross neither a request's end nor a ``chunk_size`` boundary of that request's own
token positions: a request that already has ``computed`` tokens (chunked prefill, a prefix-cache hit) first
fills its partly filled chunk, then continues in whole chunks; so the chunking of a request does not depend on
how its prefill was split. The SSD kernels take three tensors from it:

    cu_chunk_seqlens    (nchunks + 1,) int32   token offset of each logical chunk in the pack, then the total
    seq_idx             (nchunks,) int32       the request each logical chunk belongs to
    last_chunk_indices  (nrequests,) int32     each request's last logical chunk

``chunk_metadata`` is ssdiff's own statement of that rule (tested against vLLM's builder on random batches in
properties/test_vllm.py). A request without new tokens (an empty neighbour in the pack) gets no chunk when its
computed tokens fill whole chunks and one empty chunk otherwise (the partly filled chunk it would finish), and
its last chunk index is then the last chunk emitted so far, as in vLLM's builder: it names a chunk of its
predecessor, or -1 at the front of the pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


class ChunkMetadataError(ValueError):
    """The request lengths or computed-token counts cannot describe a prefill; the message says which."""


@dataclass(frozen=True)
class ChunkMetadata:
    """Python lists (the adapters turn them into int32 tensors on the device)."""

    cu_seqlens: tuple
    cu_chunk_seqlens: tuple
    seq_idx: tuple
    last_chunk_indices: tuple

    @property
    def nchunks(self) -> int:
        return len(self.seq_idx)

    def chunk_bounds(self, chunk: int) -> tuple:
        """(start, end) token offsets of logical chunk ``chunk`` in the pack."""
        return self.cu_chunk_seqlens[chunk], self.cu_chunk_seqlens[chunk + 1]


def chunk_metadata(lengths: Sequence[int], chunk_size: int,
                   computed: Optional[Sequence[int]] = None) -> ChunkMetadata:
    """The metadata for requests of ``lengths`` new tokens each (packed in order), ``computed[i]`` tokens of
    request i already processed before this prefill (default 0)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ChunkMetadataError(f"chunk_size={chunk_size!r} must be a positive integer")
    computed = list(computed) if computed is not None else [0] * len(lengths)
    if len(computed) != len(lengths):
        raise ChunkMetadataError(f"computed has {len(computed)} entries for {len(lengths)} requests")
    cu_seqlens, cu_chunks, seq_idx, last = [0], [0], [], []
    for request, (length, done) in enumerate(zip(lengths, computed)):
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ChunkMetadataError(f"lengths[{request}]={length!r} must be a non-negative integer")
        if not isinstance(done, int) or done < 0:
            raise ChunkMetadataError(f"computed[{request}]={done!r} must be a non-negative integer")
        position, end = done, done + length            # the request's own token positions
        first = True
        while position < end or (first and position % chunk_size):
            boundary = (position // chunk_size + 1) * chunk_size
            take = min(boundary, end) - position
            cu_chunks.append(cu_chunks[-1] + take)
            seq_idx.append(request)
            position += take
            first = False
        last.append(len(seq_idx) - 1)
        cu_seqlens.append(cu_seqlens[-1] + length)
    return ChunkMetadata(cu_seqlens=tuple(cu_seqlens), cu_chunk_seqlens=tuple(cu_chunks), seq_idx=tuple(seq_idx),
                         last_chunk_indices=tuple(last))


__all__ = ["ChunkMetadata", "ChunkMetadataError", "chunk_metadata"]
