"""``python -m qerl.train``: runs ``qerl.train.run`` as the main module, exactly as its own main block does."""

import runpy

runpy.run_module("qerl.train.run", run_name="__main__", alter_sys=True)
