"""Code every role shares, by subsystem: engine/, model/, wire/, node/."""
