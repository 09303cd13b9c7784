"""mlx-grpc-worker: an MLX model-serving worker for the SMG router, over gRPC."""

__version__ = "0.1.0"
