import gc
import sys

from handoff.cli import main

try:
    sys.exit(main())
finally:
    gc.freeze()  # the demo imported torch: its exit frees the objects whole, not each through the collector
