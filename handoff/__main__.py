import gc
import sys

from handoff.cli import main

try:
    code = main()
except KeyboardInterrupt:  # a Ctrl-C past the one the command handled (its cleanup, its return): still stopped by it
    code = 130
finally:
    gc.freeze()  # the demo imported torch: its exit frees the objects whole, not each through the collector
sys.exit(code)
