"""The runtime's low-bit format, under `models/` and above `kernels/`: the quantize grid (primitives), the quantized
Linear modules that run the kernels (linear), compact 2:4 storage (sparse24), Hadamard rotations (hadamard), and
how a quantized directory names its layers (record). `compress/` holds the algorithms that write this format; loading a model only reads it."""
