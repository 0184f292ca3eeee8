"""Checkpoint folders read as hostile input, without torch: shared by the engine and the sidecar.

- :mod:`.files`: opening and reading files so that no file can hold a process
  (regular files only, GIL-free system calls, bounded sizes), and the list of a
  folder's safetensors shards.
- :mod:`.safetensors_header`: a safetensors file's header, parsed and checked
  by the ``safetensors`` library's own rules (proven against it by a
  differential fuzz, ``tests/handoff/test_safetensors_header.py``).
- :mod:`.errors`: what either raises.
"""
