"""``python -m qerl.train``: runs ``qerl.train.run`` as the main module, exactly as its own main block does.

Its imports (torch, transformers, trl: seconds) run before ``qerl.cli.run`` is there to report a Ctrl-C, which then
printed a 40-60 line traceback from inside an import: one during the imports ends the command the same way, with
``interrupted`` and status 130 (the package ``qerl`` imports nothing heavy before this runs)."""

import runpy
import sys

from qerl.cli import INTERRUPTED_EXIT

try:
    runpy.run_module("qerl.train.run", run_name="__main__", alter_sys=True)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)
