#!/usr/bin/env python3
"""Writes a GGUF file's copy whose block-format tensors are decoded to F32 (gguf-py's reference
decoders; every Q4_0/Q4_1/Q8_0/k-quant value is an exact f32), metadata and float tensors kept,
general.file_type set to 0 (all F32). scripts/kld_table.sh uses it to make a float base of the
default model (SmolLM2-135M-Instruct, shipped as Q4_1) from which every other format is written.

    python3 scripts/dequant_gguf.py IN.gguf OUT.gguf      (needs: pip install gguf numpy)
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    reader = GGUFReader(sys.argv[1])
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(sys.argv[2], arch)
    for field in reader.fields.values():
        # The header's own fields and the architecture are written by GGUFWriter itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = 0 if field.name == "general.file_type" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape))
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, values, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
