"""The wire protocol's round trips against a raw Unix-socket echo, and the harness they share."""
