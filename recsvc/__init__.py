"""recsvc: generative recommender service (inference engine + gRPC service)."""
