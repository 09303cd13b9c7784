"""Generated gRPC code; regenerate with `make proto`."""
