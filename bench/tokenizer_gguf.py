"""The embedded model's metadata without its tensors (6.5 MB: the tokenizer, the chat template,
the architecture keys), for runs on a machine the 242 MB model package cannot travel to: the
bench scripts' --tokenizer-gguf, `bench/synth_gguf.py --tokenizer`, and with --standin a
package named like the embedded model's whose one chunk is that file, so that dummy weights
(which read nothing else from it) load with the real vocabulary from any process:

    python3 bench/tokenizer_gguf.py .devcarry/standin --standin       # here
    export PYTHONPATH=$PWD/.devcarry/standin:$PYTHONPATH              # there, before any run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf


def write_metadata(src: Path, dst: Path) -> Path:
    """Every key of GGUF `src` (but the counts the writer makes itself) into a tensor-less
    GGUF `dst`."""
    from muser.loading.gguf import open_gguf

    reader = open_gguf(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(dst, arch)
    made = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, field in reader.fields.items():
        if name not in made:
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a folder: tokenizer.gguf is written there")
    ap.add_argument("--model", type=Path, help="the GGUF to copy (default: the embedded model)")
    ap.add_argument("--standin", action="store_true",
                    help="also write the stand-in package into the folder (put it on PYTHONPATH)")
    args = ap.parse_args()
    if args.model is None:
        from muser.loading.default_model import default_model_path

        args.model = default_model_path(progress=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_metadata(args.model, args.out / "tokenizer.gguf")
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    if args.standin:
        from startup_h200 import standin_package

        standin_package(path, args.out)
        print(f"stand-in package in {args.out}: put it first on PYTHONPATH")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
