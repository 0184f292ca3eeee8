"""Model definition and weight loading (Llama and Qwen2 families)."""
