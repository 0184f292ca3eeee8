"""Tagged memory regions: what the engine can give back and take again."""
