"""``python -m qerl.plot``, the public name of the curves CLI; the code lives in ``qerl.train.plot``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("qerl.train.plot", run_name="__main__", alter_sys=True)
