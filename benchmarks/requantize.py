#!/usr/bin/env python
"""A GGUF file with its block-format matrices requantized by gguf-py's quantizer, the rest copied.

--type mxfp4 (the default): every Q4_1 / Q4_0 / Q8_0 matrix but the embedding in MXFP4: a dense MXFP4 model to
measure beside llama.cpp (whose quantizer writes MXFP4 only for a mixture of experts' expert tensors). --type f32:
every quantized tensor dequantized: a float32 "original" of a model published only quantized (SmolLM2 in
../shared/data), for `hearth quantize`, llama.cpp's quantizer and `hearth perplexity --kl-divergence`. Both engines
read the result; it is no published model's quality.

    python benchmarks/requantize.py ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf smol-MXFP4.gguf
    python benchmarks/requantize.py SmolLM2-135M-Instruct.Q4_1.gguf smollm2-f32.gguf --type f32
"""

from __future__ import annotations

import argparse

import gguf
import gguf.quants as quants

Q = gguf.GGMLQuantizationType
REQUANTIZED = (Q.Q4_1, Q.Q4_0, Q.Q8_0)  # into MXFP4
TARGETS = {"mxfp4": Q.MXFP4, "f32": Q.F32}


def requantized(tensor, target: Q) -> bool:
    if target == Q.F32:
        return tensor.tensor_type not in (Q.F32, Q.F16, Q.BF16)
    # the embedding stays as it is (llama.cpp reads its rows, not a matmul)
    return tensor.tensor_type in REQUANTIZED and tensor.name != "token_embd.weight"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("out")
    ap.add_argument("--type", choices=TARGETS, default="mxfp4")
    args = ap.parse_args()
    target = TARGETS[args.type]
    reader = gguf.GGUFReader(args.source)
    writer = gguf.GGUFWriter(args.out, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents(),
                             endianess=reader.endianess)
    tensors = []
    for t in reader.tensors:
        if requantized(t, target):
            tensors.append((t.name, quants.quantize(quants.dequantize(t.data, t.tensor_type), target), target))
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
    print(f"{args.out}: {sum(requantized(t, target) for t in reader.tensors)} tensors in {target.name}")


if __name__ == "__main__":
    main()
