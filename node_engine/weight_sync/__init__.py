"""Weight sync without disk: tensor payloads from a process on the same host, broadcasts from a trainer."""
