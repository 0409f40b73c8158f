#!/usr/bin/env python
"""A GGUF file with every Q4_1 / Q4_0 / Q8_0 matrix requantized to MXFP4 by gguf-py's quantizer, the rest
copied: a dense MXFP4 model to measure beside llama.cpp (whose quantizer writes MXFP4 only for a mixture of
experts' expert tensors). Both engines read the result; it is no published model's quality.

    python benchmarks/requantize_mxfp4.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf smol-MXFP4.gguf
"""

from __future__ import annotations

import argparse

import gguf
import gguf.quants as quants

REQUANTIZED = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("out")
    args = ap.parse_args()
    reader = gguf.GGUFReader(args.source)
    writer = gguf.GGUFWriter(args.out, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents(),
                             endianess=reader.endianess)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    tensors = []
    for t in reader.tensors:  # the embedding stays as it is (llama.cpp reads its rows, not a matmul)
        if t.tensor_type in REQUANTIZED and t.name != "token_embd.weight":
            tensors.append((t.name, quants.quantize(quants.dequantize(t.data, t.tensor_type), mxfp4), mxfp4))
        else:
            tensors.append((t.name, t.data, t.tensor_type))
    for field in reader.fields.values():  # (gguf-py's own copy loop, gguf_new_metadata.copy_with_new_metadata)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for name, data, qtype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    print(f"{args.out}: {sum(q == mxfp4 for _, _, q in tensors)} tensors in MXFP4")


if __name__ == "__main__":
    main()
