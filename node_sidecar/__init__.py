"""The node's only door: serializes memory release against in-flight generation (SPEC section 3)."""
