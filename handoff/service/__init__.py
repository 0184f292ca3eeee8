"""HTTP plumbing shared by the three services: errors, auth, limits, logs, serving."""
