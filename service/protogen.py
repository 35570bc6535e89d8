"""Placeholder until the gRPC issue lands: generates nothing."""
if __name__ == "__main__":
    print("no protos yet")
