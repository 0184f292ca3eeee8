"""The vision path of Qwen2-VL and Qwen2.5-VL checkpoints.

- ``arch.py``: the vision tower's shape and the multimodal token ids, read from ``config.json``;
- ``processor.py``: the image processor (``smart_resize``, rescale, normalize, patching);
- ``clamp.py``: the exact worst case of the processor, and the ``--max-image-tokens`` clamp;
- ``tower.py``: the vision transformer and its patch merger;
- ``mrope.py``: multimodal rotary positions (M-RoPE) of a prompt with images;
- ``inputs.py``: a request's images (spans in the prompt, features while prefill needs them);
- ``placeholders.py``: image placeholders in a prompt, expanded to each image's token count;
- ``decode.py``: image bytes from a request (base64, data URL, allowed local file), checked;
- ``prescan.py``: bounded walks over an image's structure, before Pillow spends unbounded time on it;
- ``encoder.py``: what the runner does with images in a step (encode, embed, free);
- ``reservation.py``: the worst-case vision peak, measured at start and held in ``workspace``.
"""
