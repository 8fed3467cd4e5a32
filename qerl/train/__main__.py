"""``python -m qerl.train``: runs ``qerl.train.run`` as the main module, exactly as its own main block does (a Ctrl-C
while it imports is one line too: ``qerl.cli.ctrl_c_ends_the_imports``, installed by the package ``qerl``)."""

import runpy

runpy.run_module("qerl.train.run", run_name="__main__", alter_sys=True)
