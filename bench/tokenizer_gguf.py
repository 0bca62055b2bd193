"""A GGUF file holding only the embedded model's metadata (its tokenizer, chat template and
shape), no tensors: 6.5 MB, so a device call can carry it where the 270M file cannot, and
`LLM(load_format="dummy")` still has its tokenizer there.

    python3 bench/tokenizer_gguf.py .devcarry/tokenizer.gguf

The benches' `--tokenizer-gguf` takes it (bench/startup_h200.py standin_package) and
bench/synth_gguf.py copies its tokenizer keys.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np


def write(dst: Path) -> None:
    from muser.loading.default_model import default_model_path
    from muser.loading.gguf import open_gguf

    r = open_gguf(default_model_path(False))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY and f.types[1] == gguf.GGUFValueType.STRING:
            w.add_key_value(name, [bytes(f.parts[i]).decode("utf-8", "surrogateescape")
                                   for i in f.data], t, sub_type=f.types[1])
        elif t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, np.concatenate([f.parts[i] for i in f.data]).tolist(), t,
                            sub_type=f.types[1])
        else:
            w.add_key_value(name, f.contents(), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    write(ap.parse_args().file)
