"""The top-level "type" and "id" of a client frame that msgspec cannot decode (a str somewhere
not UTF-8, nesting deeper than its recursion limit), so the error still reaches the request it
belongs to (ipc/codec.py). A scan of msgpack item headers without recursion: only the top-level
map's keys and their str values are read, everything else is skipped by its size."""

from __future__ import annotations

from typing import Any

# How big a msgpack item is, by its type code (fixints, fixmaps, fixarrays and fixstrs carry
# their size in the code): payload bytes fixed by the code (nil, bools, numbers, fixext); a
# length in the next bytes (bin, ext with its type byte, str); a count of child items (arrays,
# maps: two each).
_FIXED_PAYLOAD = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4,
                  0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5,
                  0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1),
          0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0)}  # (length bytes, extra bytes): bin, ext, str
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # (count bytes, items each)
_STR_CODES = {*range(0xa0, 0xc0), 0xd9, 0xda, 0xdb}
MAX_SCAN_ITEMS = 1 << 17  # an id behind more items than this is not looked for (~30 ms)


def _header(frame: bytes, pos: int) -> tuple[int, int, int]:
    """(payload start, payload bytes, child items) of the msgpack item at `pos`."""
    b = frame[pos]
    pos += 1
    if b <= 0x7f or b >= 0xe0:  # fixints
        return pos, 0, 0
    if b <= 0x9f:  # fixmap, fixarray
        return pos, 0, (b & 0x0f) * (2 if b <= 0x8f else 1)
    if b <= 0xbf:  # fixstr
        return pos, b & 0x1f, 0
    if b in _FIXED_PAYLOAD:
        return pos, _FIXED_PAYLOAD[b], 0
    if b in _SIZED:
        n, extra = _SIZED[b]
        return pos + n, int.from_bytes(frame[pos:pos + n], "big") + extra, 0
    n, per = _COUNTED[b]  # KeyError for 0xc1, which msgpack never uses
    return pos + n, 0, int.from_bytes(frame[pos:pos + n], "big") * per


def frame_head(frame: bytes) -> dict[str, Any]:
    """The top-level "type" and "id" strs of a frame msgspec could not read (a str elsewhere
    not UTF-8, nesting too deep): scanned without recursion, skipping everything else."""
    head: dict[str, Any] = {}
    budget = MAX_SCAN_ITEMS

    def read(pos: int) -> tuple[Any, int]:  # (the item if a str, else None; where it ends)
        nonlocal budget
        value, pending = None, 1
        if frame[pos] in _STR_CODES:
            start, size, _ = _header(frame, pos)
            try:
                value = frame[start:start + size].decode()
            except UnicodeDecodeError:  # not this str, but maybe the next
                pass
        while pending:
            budget -= 1
            if budget < 0:
                raise ValueError("scan budget spent")
            start, size, children = _header(frame, pos)
            pos, pending = start + size, pending - 1 + children
        return value, pos

    try:
        if not (0x80 <= frame[0] <= 0x8f or frame[0] in (0xde, 0xdf)):
            return head
        pos, _, items = _header(frame, 0)
        for _ in range(items // 2):
            key, pos = read(pos)
            value, pos = read(pos)
            if key in ("type", "id"):
                head.setdefault(key, value)
    except (IndexError, KeyError, ValueError):
        pass  # cut short or unreadable from here on: what was read so far stands
    return head


# Containers' type codes (fixmap, fixarray, array16/32, map16/32): a frame with fewer of these
# bytes than the limit cannot nest that deep, so most frames skip the scan below.
_NOT_CONTAINER_CODES = bytes(b for b in range(256)
                             if not (0x80 <= b <= 0x9f or 0xdc <= b <= 0xdf))


def nests_deeper_than(frame: bytes, limit: int) -> bool:
    """Whether any item of `frame` sits more than `limit` containers deep. Scanned without
    recursion, so the answer does not depend on how much stack the caller has left (msgspec's
    own limit does: it is Python's recursion limit less the caller's depth)."""
    if len(frame.translate(None, _NOT_CONTAINER_CODES)) <= limit:
        return False
    pending = [1]  # items still to read at each open level
    pos = 0
    try:
        while pending:
            start, size, children = _header(frame, pos)
            pos = start + size
            pending[-1] -= 1
            if children:
                if len(pending) > limit:
                    return True
                pending.append(children)
            while pending and pending[-1] == 0:
                pending.pop()
    except (IndexError, KeyError):
        return False  # cut short or unreadable: msgspec says what is wrong with it
    return False
