"""``python -m qerl.quantize``: the quantize command (``qerl.quantize.run``), as ``llm-compressor/quantize_nvfp4.py``
runs it."""

import sys

from qerl.quantize.run import main

sys.exit(main())
