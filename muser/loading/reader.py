"""GGUF metadata: `field` reads one value; FastGGUFReader is a GGUFReader with vectorized
metadata arrays: the stock reader walks a 262,144-entry vocabulary one numpy view at a time
(~10 s); this reads scalar arrays in one view and string arrays with one pass over the
lengths. Fields keep the stock `ReaderField` layout."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType

from muser.errors import ModelLoadError


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Metadata value `key` as a Python object; `default` when absent, an error when absent
    and no default is given."""
    found = reader.fields.get(key)
    if found is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata lacks '{key}'")
        return default
    return found.contents()


class FastGGUFReader(gguf.GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(int(raw_itype[0]))
        count, offs = int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, itype]
        if itype in self.gguf_scalar_to_np:
            values = self._get(offs, self.gguf_scalar_to_np[itype], count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2] if count else [], types
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[Any] = [raw_itype, alen]
        # NOTE: views of a plain ndarray, not of the np.memmap: a memmap view runs a Python
        # __array_finalize__ (~5 us each, two views per string)
        buf = self.data.view(np.ndarray)
        lengths = memoryview(buf)
        for _ in range(count):
            n = int.from_bytes(lengths[offs:offs + 8], "little")
            parts += [buf[offs:offs + 8].view(np.uint64), buf[offs + 8:offs + 8 + n]]
            offs += 8 + n
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types
