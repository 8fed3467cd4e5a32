"""The quantizer's parts that ``qerl.quantize`` orchestrates: where the output may go (``target``),
what the source must satisfy (``source``), and the quantization methods beyond round-to-nearest."""
